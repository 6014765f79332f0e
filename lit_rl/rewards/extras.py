"""Optional packages a built-in reward or environment needs, named with the extra that installs them."""

from __future__ import annotations

import importlib.util

#: import name -> (pip name, lit-rl extra)
OPTIONAL = {"math_verify": ("math-verify", "envs"), "reasoning_gym": ("reasoning-gym", "envs"),
            "verifiers": ("verifiers", "envs")}


def require(module: str, user: str) -> None:
    """Raise one message naming the extra to install when `module` is missing (checked when a
    config names the reward or environment, before any server starts)."""
    if importlib.util.find_spec(module) is None:
        package, extra = OPTIONAL[module]
        raise ImportError(f"{user} needs the {package!r} package: pip install 'lit-rl[{extra}]' "
                          f"(or pip install {package})")
