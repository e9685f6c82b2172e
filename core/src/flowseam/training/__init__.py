"""Training: methods that turn rollouts or data into weight updates, all registered as plugins.

Methods (``finetune``, ``flowgrpo``, ``workflow_rl``, and any third party's) are found through the
``flowseam_training_methods`` hook, rewards through ``flowseam_rewards``. They drive the same loops
that serve (:func:`flowseam.loops.run_loop`): a rollout is serve plus capture.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidInputError


def _claims(attr: str) -> dict[str, list[tuple[Any, Any]]]:
    """name → [(plugin record, object)] over every usable plugin, in plugin-name order."""
    from ..seam.discovery import discover

    found: dict[str, list[tuple[Any, Any]]] = {}
    for rec in sorted(discover().usable(), key=lambda r: r.name):
        for name, obj in getattr(rec, attr).items():
            found.setdefault(name, []).append((rec, obj))
    return found


def _imported(rec: Any, obj: Any) -> Any:
    """``obj`` itself, or for an import path ``"package.module:attr"`` (how a plugin may register
    a method without importing it at discovery) the object it names.

    :raises PluginLoadError: naming the plugin and the path when it cannot be imported.
    """
    if not isinstance(obj, str):
        return obj
    from ..errors import PluginLoadError
    from ..seam.discovery import _entry_point_value_loader

    try:
        value = _entry_point_value_loader(rec.name, obj)()  # resolved as an entry point's value
    except Exception as exc:
        raise PluginLoadError(f"plugin {rec.name!r} ({rec.distribution} {rec.version}) registers "
                              f"{obj!r}, which cannot be imported: {type(exc).__name__}: "
                              f"{exc}") from exc
    return value


def _registered(attr: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, claims in _claims(attr).items():
        if len(claims) == 1:
            out[name] = _imported(*claims[0])
        else:  # a conflict: only the qualified names resolve
            out.update({f"{rec.name}:{name}": _imported(rec, obj) for rec, obj in claims})
    return out


def _resolve_claim(attr: str, what: str, name: str) -> tuple[Any, Any]:
    """``(plugin record, object)`` registered as ``name`` (or ``"plugin:name"``).

    :raises InvalidInputError: for an unknown name (listing the registered ones), or a name that
        two or more plugins register (listing them, and how to choose): never a silent winner.
    """
    claims = _claims(attr)
    plugin, sep, short = name.rpartition(":")
    if sep and short in claims:
        for rec, obj in claims[short]:
            if rec.name == plugin:
                return rec, _imported(rec, obj)
    if name not in claims:
        raise InvalidInputError(
            f"unknown {what} {name!r}; registered {attr}: {sorted(_registered(attr))}")
    if len(claims[name]) > 1:
        who = ", ".join(f"{rec.name!r} ({rec.distribution} {rec.version})" for rec, _ in claims[name])
        first = claims[name][0][0].name
        others = ",".join(rec.name for rec, _ in claims[name][1:])
        raise InvalidInputError(
            f"{what} {name!r} is registered by {len(claims[name])} plugins: {who}; flowseam does "
            f"not pick one silently. Name one as '{first}:{name}', or block the others with "
            f"FLOWSEAM_DISABLE_PLUGINS={others}")
    rec, obj = claims[name][0]
    return rec, _imported(rec, obj)


def _resolve(attr: str, what: str, name: str) -> Any:
    """The object registered as ``name`` (or ``"plugin:name"``); see :func:`_resolve_claim`."""
    return _resolve_claim(attr, what, name)[1]


def registered_methods() -> dict[str, Any]:
    """Every registered training method: name → class (from the discovered plugins; each
    imported). A name two plugins register appears only qualified, as ``"<plugin>:<name>"``.

    :raises PluginLoadError: if a method a plugin registers by import path cannot be imported.
    """
    return _registered("methods")


def get_method(name: str) -> Any:
    """The training method ``name`` (or ``"<plugin>:<name>"``).

    :raises FlowseamError: for an unknown method (listing the registered ones), or one that
        several plugins register (naming them).
    :raises PluginLoadError: if the plugin registered it by an import path that cannot be
        imported (naming the plugin and the path).
    """
    return _resolve("methods", "training method", name)


def registered_rewards() -> dict[str, Any]:
    """Every registered reward: name → reward (or factory); conflicting names qualified."""
    return _registered("rewards")


def get_reward(name: str, **kwargs: Any):
    """Resolve a reward plugin by name (or ``"<plugin>:<name>"``); a factory (class) is called
    with ``kwargs``. This is the registered object itself; a training method builds its reward
    from the config with :func:`flowseam.training.rewards.build_reward` (weighted sums, reward
    servers, a timeout and checked calls).

    :raises InvalidInputError: for an unknown reward (listing the registered ones), one that
        several plugins register (naming them), ``kwargs`` the factory does not take (or any for
        a reward that is not a factory), or what the factory's ``__init__`` refuses.
    """
    from .rewards import make_reward

    return make_reward(name, _resolve("rewards", "reward", name), kwargs)


def train(method: str, config: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Run training method ``method`` with ``config``; returns the method's summary."""
    return get_method(method)(config).run(progress=progress)
