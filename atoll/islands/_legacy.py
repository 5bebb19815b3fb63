"""The deprecated form ``DiLoCo(model, inner_optimizer, coordinator=..., run_id=..., island_id=...)``:
the link built from its keyword arguments, and a warning once per process naming the new form. Goes
with the next release."""

from __future__ import annotations

import inspect
import warnings

from atoll.islands._link import CoordinatorLink

LINK_ARGUMENTS = frozenset(inspect.signature(CoordinatorLink).parameters) - {"connect"}
"""The keyword arguments of the deprecated form that belong to the link."""
_legacy_warned = False


def from_deprecated_form(inner_optimizer, options: dict) -> tuple[CoordinatorLink, dict]:
    """``DiLoCo(model, inner_optimizer, coordinator=..., run_id=..., ...)``: the link built from its
    keyword arguments, and the rest as options; warns once per process, naming the new form."""
    global _legacy_warned
    if "coordinator" not in options:
        raise TypeError("DiLoCo(model, link, **options) needs a CoordinatorLink (or the deprecated coordinator=)")
    options = dict(options)
    link_kw = {k: options.pop(k) for k in list(options) if k in LINK_ARGUMENTS}
    factory = options.pop("client_factory", None)
    if factory is not None:
        retry, token, tls = link_kw.get("retry"), link_kw.get("token"), link_kw.get("tls")
        link_kw["connect"] = lambda address: factory(address, retry=retry, token=token, tls=tls)
    if options.pop("keep_last_delta", False):
        warnings.warn("keep_last_delta is gone: call sync.pseudo_gradient() (e.g. in before_push)", FutureWarning, 3)
    if not _legacy_warned:
        _legacy_warned = True
        warnings.warn(
            "DiLoCo(model, inner_optimizer, coordinator=..., run_id=..., island_id=...) is deprecated and will "
            "be removed in the next release; use DiLoCo(model, CoordinatorLink(coordinator, run_id=..., "
            "island_id=...), **options) (the inner optimizer is not needed)",
            FutureWarning,
            stacklevel=3,
        )
    del inner_optimizer  # never used: the user's loop steps it
    return CoordinatorLink(**link_kw), options
