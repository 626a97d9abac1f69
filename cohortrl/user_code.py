"""Loading the user's own code named in a config: ``path/to/file.py:name`` or ``package.module:name``.

Reward functions, dataset transforms and plug-in modules (``imports:``) all come through here, so every
one of them fails the same way, before training starts, with a message naming the reference and the fix:
a missing file, a module that does not import, a missing name, or a function with the wrong signature.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable


class UserCodeError(ValueError):
    """User code named in a config could not be loaded or does not have the required shape."""


def import_module(target: str, ref: str, what: str, error: type[Exception] = UserCodeError) -> ModuleType:
    """The module ``target`` (a ``.py`` path or a dotted module name) that ``ref`` points into."""
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise error(f"{what} file not found: {target} (from '{ref}'; relative paths start at {Path.cwd()})")
        # One module object per file, so loading the same file twice (a reward and a transform) runs it once.
        name = f"cohortrl_user.{path.resolve().with_suffix('').as_posix().strip('/').replace('/', '.')}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        module.__cohortrl_file__ = target  # lets `callable_ref` name its functions again
        sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise error(f"{what} file {target} raised {type(e).__name__} while being imported: {e}") from e
        return module
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise error(f"cannot import module '{target}' for {what} '{ref}': {e}") from None


def load_object(ref: str, what: str, error: type[Exception] = UserCodeError) -> Any:
    """The object ``ref`` names (``file.py:name`` or ``module:name``); ``what`` says what it is for errors."""
    if ":" not in ref:
        raise error(f"{what} '{ref}' must look like path/to/file.py:name or package.module:name")
    target, attr = ref.rsplit(":", 1)
    module = import_module(target, ref, what, error)
    if not hasattr(module, attr):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise error(f"{target} has no '{attr}' (from {what} '{ref}'); it defines: {', '.join(defined) or 'nothing callable'}")
    return getattr(module, attr)


def import_plugin(ref: str) -> ModuleType:
    """Import a module or ``.py`` file for its side effects (registering estimators, losses, tasks, rewards)."""
    return import_module(ref, ref, "imports entry")


def check_reward_signature(fn: Callable, name: str, error: type[Exception] = UserCodeError) -> None:
    """A reward function is called as TRL calls it, by keyword: ``fn(prompts=, completions=, completion_ids=,
    trainer_state=, **columns)``. So it needs a ``**kwargs`` for what it does not name, and no positional-only
    parameter without a default. ``def f(completions, **kwargs)`` and ``def f(prompts, completions, answer,
    **kwargs)`` both work (a named parameter receives the column of that name)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to inspect, its call will tell
    params = list(sig.parameters.values())
    var_keyword = any(p.kind == p.VAR_KEYWORD for p in params)
    positional_only = [p.name for p in params if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    if var_keyword and not positional_only:
        return
    raise error(
        f"reward function '{name}' has signature {getattr(fn, '__name__', type(fn).__name__)}{sig}; reward functions "
        "are called by keyword as in TRL (prompts=, completions=, completion_ids=, trainer_state= and every dataset "
        "column), so it must take **kwargs and no positional-only parameters, e.g. def f(completions, **kwargs); "
        "it returns one float or None per completion"
    )


def callable_ref(fn: Callable) -> str | None:
    """``module:qualname`` when ``fn`` can be imported back by that name (so a saved config can name it),
    else None (a lambda, a closure, or a function defined in a script's ``__main__``)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    if module.startswith("cohortrl_user."):  # loaded from a file by `import_module`: name the file
        source = sys.modules.get(module)
        file = getattr(source, "__cohortrl_file__", None)
        return f"{file}:{qualname}" if file and getattr(source, qualname, None) is fn else None
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if obj is fn else None
