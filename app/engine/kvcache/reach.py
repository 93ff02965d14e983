"""Which layers a compressed cache can serve, decided from each layer's attention module.

A compressed cache hands attention a K/V object that only the attention dispatch can read
(IsoQuantTensor). That works when the module passes the fetched K/V straight to mlx-lm's
`scaled_dot_product_attention` (the name the dispatch replaces); a module that does its own
maths on them (gemma2's softcapping, stablelm's astype, plamo2's mx.fast call, MLA's latent
projections) keeps a float cache. Head dims are checked by the cache itself on first update.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap

log = logging.getLogger(__name__)

_SDPA = "scaled_dot_product_attention"
_FETCH = "update_and_fetch"
_HARMLESS_ATTRS = ("shape", "dtype")  # what IsoQuantTensor answers like an array


def _call_name(node: ast.AST) -> str | None:
    f = node.func if isinstance(node, ast.Call) else None
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _fetch_names(stmt: ast.stmt) -> set[str]:
    """Names bound by `a, b = cache.update_and_fetch(...)` in this statement (else empty)."""
    if isinstance(stmt, ast.Assign) and _call_name(stmt.value) == _FETCH:
        names = set()
        for t in stmt.targets:
            elts = t.elts if isinstance(t, ast.Tuple) else [t]
            names |= {e.id for e in elts if isinstance(e, ast.Name)}
        return names
    return set()


def _after(body: list[ast.stmt]) -> list[tuple[set[str], list[ast.stmt]]]:
    """For each fetch in `body` (any depth): (names, the statements that run after it)."""
    found = []
    for i, stmt in enumerate(body):
        rest = body[i + 1 :]
        names = _fetch_names(stmt)
        if names:
            found.append((names, rest))
            continue
        for block in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, block, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                found += [(n, after + rest) for n, after in _after(inner)]
    return found


def _bad_uses(names: set[str], stmts: list[ast.stmt]) -> list[str]:
    """Uses of the fetched names other than as arguments of scaled_dot_product_attention."""
    allowed = set()
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and _call_name(node) == _SDPA:
                if isinstance(node.func, ast.Name):  # the module-level name, not mx.fast's
                    allowed |= {id(a) for a in node.args}
                    allowed |= {id(k.value) for k in node.keywords}
            if isinstance(node, ast.Attribute) and node.attr in _HARMLESS_ATTRS:
                allowed.add(id(node.value))
            if isinstance(node, ast.Return) and node.value is not None:
                # handed on as they are (gemma4's KV sharing: a later layer's attention reads them)
                allowed |= {id(n) for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    bad = []
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load):
                if id(node) not in allowed:
                    bad.append(ast.unparse(stmt).splitlines()[0][:80])
                    break
    return bad


@functools.cache
def class_reason(cls: type) -> str | None:
    """Why attention class `cls` cannot take a compressed K/V (None: it can)."""
    cls = _source_class(cls)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__call__)))
    except (OSError, TypeError, SyntaxError):
        return f"{cls.__name__}'s source is not readable, so its use of the cache is unknown"
    fn = tree.body[0]
    fetches = _after(fn.body)
    if not fetches:
        return f"{cls.__name__} updates its cache outside __call__"
    for names, rest in fetches:
        bad = _bad_uses(names, rest)
        if bad:
            return f"{cls.__name__} does its own maths on the cached K/V ({bad[0]!r})"
    return None


def _source_class(cls: type) -> type:
    """The class whose source says how the module uses its cache: mlx-lm's, for a module whose
    decode step the engine compiled (compiled.py keeps it as `_rq_original`)."""
    return cls.__dict__.get("_rq_original", cls)


@functools.cache
def _has_fetch(cls: type) -> bool:
    cls = _source_class(cls)
    try:
        return _FETCH in inspect.getsource(cls.__call__)
    except (OSError, TypeError):
        return False


def attention_module(layer):
    """The submodule of `layer` that updates a KV cache (None if there is none)."""
    found = [m for m in layer.modules() if _has_fetch(type(m))]
    inner = [m for m in found if m is not layer]
    return (inner or found or [None])[0]


def attention_class(layer):
    """The class of `layer`'s attention module (None: it has none). A layer that runs on another
    rank (distributed/stage.py) keeps its original attention's class as `rq_attention_class`."""
    if hasattr(layer, "rq_attention_class"):
        return layer.rq_attention_class
    m = attention_module(layer)
    return None if m is None else type(m)


def layer_reasons(model, caches: list, compressible) -> dict[int, str | None]:
    """{cache index: why that cache stays float (None: it can be compressed)} for the caches
    `compressible(c)` selects, each matched to its layer's attention module."""
    idx = [i for i, c in enumerate(caches) if compressible(c)]
    layers = list(getattr(model, "layers", []) or [])
    if len(caches) == len(layers):
        mods = {i: attention_class(layers[i]) for i in idx}
    else:  # hybrid models (caches only where a layer has state): attention layers in order
        attn = [m for m in map(attention_class, layers) if m is not None]
        if len(attn) != len(idx):
            why = f"{len(idx)} KV caches for {len(attn)} attention layers: cannot match them"
            return {i: why for i in idx}
        mods = dict(zip(idx, attn, strict=True))
    out = {}
    for i in idx:
        m = mods[i]
        out[i] = "no attention module found in its layer" if m is None else class_reason(m)
    return out


def log_fallbacks(reasons: dict[int, str | None], mode: str) -> list[dict]:
    """[{"layer", "reason"}] of the layers kept float, logged once per distinct reason."""
    out = [{"layer": i, "reason": r} for i, r in sorted(reasons.items()) if r]
    for r in sorted({f["reason"] for f in out}):
        layers = [f["layer"] for f in out if f["reason"] == r]
        log.warning("%s: %d layer(s) keep a float cache: %s", mode, len(layers), r)
    return out
