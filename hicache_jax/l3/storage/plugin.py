"""Load a deployment's own L3 backend from ``python://package.module:ClassName?key=value``.

The class is called as ``ClassName(spec, host_buffer, layout, **options)`` (query values are
passed as strings; keyword options given to ``open_storage`` win) and the object it returns must
provide every method of ``StorageBackend`` (``exists``, ``get_into``, ``put_from``, ``stats``,
``close``) and the ``url`` / ``spec`` attributes. Every check happens before anything is cached:
a missing module, class or method raises ``ValueError`` / ``TypeError`` naming it.
"""

from __future__ import annotations

import importlib
import urllib.parse
from typing import Any

PROTOCOL_METHODS = ("exists", "get_into", "put_from", "stats", "close")


def resolve_class(url: str) -> tuple[type, dict[str, str]]:
    """The class named by a ``python://`` URL and its query options (strings).

    Raises:
        ValueError: malformed URL, missing module or class (the message names it).
        TypeError: the target is not a class, or lacks a protocol method (named).
    """
    parsed = urllib.parse.urlsplit(url)
    target = urllib.parse.unquote(parsed.netloc + parsed.path)
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"storage url={url!r} must be python://package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"storage url={url!r}: cannot import module {module_name!r} ({exc})"
        ) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"storage url={url!r}: module {module_name!r} has no class {class_name!r}")
    if not isinstance(cls, type):
        raise TypeError(f"storage url={url!r}: {module_name}:{class_name} is not a class")
    missing = [m for m in PROTOCOL_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(
            f"storage url={url!r}: class {class_name} lacks protocol method(s) {', '.join(missing)}"
        )
    options = dict(urllib.parse.parse_qsl(parsed.query, keep_blank_values=True))
    return cls, options


def open_plugin(url: str, spec: Any, host_buffer: Any, layout: Any, **options: Any) -> Any:
    """Instantiate the backend of a ``python://`` URL and check the instance's protocol."""
    cls, query = resolve_class(url)
    backend = cls(spec, host_buffer, layout, **(query | options))
    missing = [a for a in ("url", "spec") if not hasattr(backend, a)]
    if missing:
        close = getattr(backend, "close", None)
        if callable(close):
            close()
        raise TypeError(
            f"storage url={url!r}: backend instance lacks attribute(s) {', '.join(missing)}"
        )
    return backend
