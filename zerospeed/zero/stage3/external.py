"""Parameters a forward uses that no hook gathered: read off another module, or returned by their own.

Note [undeclared external parameters]: stage 3 gathers a module's units around its forward and
backward: the parameters it owns or registers, and those declared with `register_external_parameter`
(strategy.py). Two patterns use a sharded parameter outside those windows, and DeepSpeed trains both:

- a forward that reads another module's parameter as an attribute (`F.linear(h, self.head.weight)`
  where `self.head` never runs): the parameter is still sharded, an empty tensor, and the op fails
  ("size mismatch ... vec (0)");
- a module that returns one of its own parameters (`return out, self.bias`) for its caller to use
  after the module's post-hook has released it.

DeepSpeed replaces each module's `_parameters` with a dict that gathers a sharded parameter on read
during a forward and registers it as an external parameter of the running module; it also registers
returned parameters with the caller. `ExternalUses` is the same mechanism with zerospeed's explicit
lifecycle: the stage-3 strategy's modules read their parameters through `WatchedParameters` (a dict
whose only difference is that a read during a forward reports the parameter), and

- a read of a parameter that is not gathered, while the model's forward runs, gathers its unit now
  and adds the unit to the uses of the innermost module whose hooks are running (`uses` in
  strategy.py, and `register_external_parameter`'s tag), so from then on that module's pre-forward
  hook gathers it, its backward pre-hook gathers it again for backward (this very step too: the hook
  reads the uses when it runs), and its post-hook releases it. A read from a module without hooks
  of its own above every hooked one (a root that owns no parameters) has nowhere to register: the
  unit is held gathered until the micro-step ends (the backward has run);
- a parameter in a module's output (a tensor, or one inside tuples, lists, dicts) keeps its unit
  gathered until the micro-step ends, instead of being released by that module's post-hook.

Reads outside a forward (optimizer code, checkpoints, `model.weight.shape` between steps) and reads
of a gathered parameter cost one dict lookup and a state check. `close` gives the modules plain
dicts back. The strategy is held weakly by everything here, so a model kept after its engine is
dropped does not keep the engine alive (Note [owners held weakly], zero/tags.py).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_leaves

from zerospeed.zero import tags
from zerospeed.zero.stage3.flat_param import State

_active: weakref.ref | None = None  # the ExternalUses whose model's forward is running, if any


class WatchedParameters(dict):
    """A module's `_parameters`: a plain dict whose reads, during a stage-3 forward, report the parameter
    (Note [undeclared external parameters]). Pickles and copies as a plain dict."""

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        if _active is not None and value is not None and not torch.compiler.is_compiling():
            uses = _active()
            if uses is not None:
                uses.on_read(value)
        return value

    def __reduce__(self):
        return dict, (dict(self),)


class ExternalUses:
    """Note [undeclared external parameters]: the reads and returns that the strategy's hooks do not cover."""

    def __init__(self, strategy, root: torch.nn.Module, modules: list[torch.nn.Module]):
        self._strategy = weakref.ref(strategy)
        self._flat_ids = {id(fp) for fp in strategy.flat}
        self._stack: list[torch.nn.Module] = []  # the hooked modules whose forward is running, innermost last
        self._held: dict[int, object] = {}  # id(flat param) -> flat param kept gathered to the end of the micro-step
        self._watched = []
        for m in modules:
            if type(m._parameters) is dict:
                m._parameters = WatchedParameters(m._parameters)
                self._watched.append(weakref.ref(m))
        me = weakref.ref(self)
        self._hooks = [
            root.register_forward_pre_hook(lambda *_: _set_active(me)),
            root.register_forward_hook(lambda *_: _set_active(None), always_call=True),
        ]

    # -- the strategy's hooks report here -------------------------------------------------------------
    def enter(self, module: torch.nn.Module) -> None:
        """`module`'s pre-forward hook has gathered its uses; its forward starts."""
        self._stack.append(module)

    def leave(self, module: torch.nn.Module, output) -> None:
        """`module`'s forward returned `output`: units of parameters in it stay gathered (before its release)."""
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        if isinstance(output, torch.Tensor) and not isinstance(output, torch.nn.Parameter):
            return
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.nn.Parameter):
                fp = tags.owner_of(leaf)
                if fp is not None and id(fp) in self._flat_ids:
                    self._held[id(fp)] = fp

    def holds(self, fp) -> bool:
        """Whether `fp` must stay gathered until the micro-step ends."""
        return id(fp) in self._held

    def start_micro_step(self) -> None:
        """A new forward: anything still held from an earlier one (a forward with no backward) goes."""
        held, self._held = self._held, {}
        self._stack.clear()
        for fp in held.values():
            if not fp.persistent and fp.state is not State.SHARDED:
                fp.release()

    # -- a read through WatchedParameters --------------------------------------------------------------
    def on_read(self, param) -> None:
        fp = tags.owner_of(param)
        if fp is None or fp.state is State.FULL or id(fp) not in self._flat_ids:
            return
        strategy = self._strategy()
        if strategy is None:
            return
        holder = self._stack[-1] if self._stack else None
        if holder is None:
            self._held[id(fp)] = fp
        else:
            tags.add_external(holder, param)
            uses = strategy.uses.setdefault(id(holder), [])
            if not any(u is fp for u in uses):
                uses.append(fp)
        strategy._fetch([fp])

    def close(self) -> None:
        """Plain dicts back on the modules; no more reports."""
        global _active
        for ref in self._watched:
            m = ref()
            if m is not None and type(m._parameters) is WatchedParameters:
                m._parameters = dict(m._parameters)
        self._watched = []
        for h in self._hooks:
            h.remove()
        if _active is not None and _active() is self:
            _active = None


def _set_active(uses: weakref.ref | None) -> None:
    global _active
    _active = uses
