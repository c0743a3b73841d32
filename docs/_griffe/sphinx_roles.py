"""A griffe extension for the API reference: the package's docstrings cross-reference with
Sphinx roles (``:meth:`load_back```, ``:class:`~hicache_jax.l3.prefetch.PrefetchHandle```),
which Markdown would show as written. Each role becomes inline code of its target (the last
dotted part where the target starts with ``~``, as Sphinx shows it)."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:meth|func|class|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
