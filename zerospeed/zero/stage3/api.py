"""User-facing stage-3 API: `zero.Init`, `zero.GatheredParameters`, `register_external_parameter`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.nn.modules import module as _module_mod

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.comm.handles import MultipleAllGatherHandles  # noqa: F401 (DeepSpeed's name at this path)
from zerospeed.utils.errors import ConfigError
from zerospeed.zero import tags
from zerospeed.zero.partition import padded_size
from zerospeed.zero.stage3.flat_param import FlatParam, State
from zerospeed.zero.stage3.flat_param import ZeroParameter as ZeroParameter  # DeepSpeed reads ds_* off it
from zerospeed.zero.stage3.flat_param import ZeroParamStatus as ZeroParamStatus  # `partition_parameters` name


def _dtype_from_config(config) -> torch.dtype:
    if config is None:
        return torch.float32
    raw = config if isinstance(config, dict) else json.loads(Path(config).read_text())
    if raw.get("fp16", {}).get("enabled") is True:
        return torch.float16
    if raw.get("bf16", {}).get("enabled") is True:
        return torch.bfloat16
    return torch.float32


class Init:
    """Build (or take) a model so that it never exists whole on any rank.

    `with zero.Init(): model = Net()` — every submodule is sharded across the data-parallel ranks as
    soon as its constructor has finished (the moment it is attached to its parent), so at most one
    module's parameters are full at a time. Construction runs for real, so random initialisation
    consumes the RNG exactly as an unsharded construction would. A whole-model initialisation run at
    the end of the root constructor (the transformers convention: a `_init_weights(module)` method
    applied to every module) is replayed after construction, one module at a time, in the same order
    — so every rank ends with exactly the values an unsharded construction under the same seed gives.

    `zero.Init(module=model)` shards an existing model. `enabled=False` does nothing.

    Note [where zero.Init shards live]: on this rank's accelerator device (the one the engine will
    train on), wherever the module was built — the all-gathers that rebuild full parameters are
    device collectives (NCCL refuses host tensors). `remote_device="cpu"` or `"nvme"` keeps the
    shards in host memory instead (pinned with `pin_memory=True`); a gather then copies them to the
    device first (stage3/gather.py). The engine re-places them according to `offload_param` later.
    A CPU-only run keeps everything on the host, exactly as before.
    """

    def __init__(
        self,
        config_dict_or_path=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        remote_device: str | None = None,
        module: torch.nn.Module | None = None,
        data_parallel_group=None,
        config=None,
        mpu=None,
        pin_memory: bool = False,
        mem_efficient_linear: bool = True,
    ):
        # `mem_efficient_linear`: DeepSpeed swaps F.linear for an autograd function that saves no gathered
        # weight for backward; here a linear layer's saved weight is a view of its unit's buffer that is
        # freed at release and re-gathered for backward (Note [freed in place], flat_param.py), which
        # already costs no memory, so either value is accepted and changes nothing.
        del mem_efficient_linear
        if remote_device not in (None, "cpu", "none", "nvme"):
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}): use None, 'cpu' or 'nvme'")
        self.remote_device = remote_device
        self.pin_memory = pin_memory
        self.enabled = enabled
        self.dtype = dtype or _dtype_from_config(config_dict_or_path if config_dict_or_path is not None else config)
        self.group = mpu.get_data_parallel_group() if mpu is not None else data_parallel_group
        self._hook = None
        self._roots: list[torch.nn.Module] = []
        self._built_on: dict[int, torch.device] = {}  # id(flat param) -> where its module was constructed
        self._owners: list = []  # the flat parameters this context made
        if enabled and module is not None:
            comm.init_distributed()
            for m in module.modules():
                self._shard_module(m)

    # -- context -----------------------------------------------------------------------------------
    def __enter__(self):
        if self.enabled:
            comm.init_distributed()
            self._attached: set[int] = set()
            self._parents: dict[int, torch.nn.Module] = {}
            self._hook = _module_mod.register_module_module_registration_hook(self._on_child)
        return self

    def _on_child(self, parent, name, child):
        # `child` is being attached to `parent`: its constructor has returned, shard what it owns
        if child is not None:
            self._attached.add(id(child))
            self._parents[id(parent)] = parent
            for m in child.modules():
                self._shard_module(m)
        return None

    def __exit__(self, exc_type, *exc):
        if self._hook is None:
            return False
        self._hook.remove()
        self._hook = None
        if exc_type is None:
            # the roots are the parents that were never attached to anything themselves
            roots = [p for k, p in self._parents.items() if k not in self._attached]
            for root in roots:
                self.finish(root)
            self._forget_replaced(roots)
        return False

    def _forget_replaced(self, roots: list[torch.nn.Module]) -> None:
        """Untag the parameters construction sharded and then dropped (a head's own weight that its
        constructor replaced by the tied embedding's): their tags hold zero.Init's owners strongly
        (Note [owners held weakly], zero/tags.py), a cycle only the garbage collector would free;
        broken here, each such owner and its shard go as soon as this context lets go of them."""
        live = {id(p) for root in roots for p in root.parameters()}
        for owner in self._owners:
            for p in owner.params:
                if id(p) not in live:
                    tags.clear_owner(p)
        self._owners = []

    def finish(self, root: torch.nn.Module) -> torch.nn.Module:
        """Shard the root's own parameters and replay its `_init_weights` (see the class docstring)."""
        for m in root.modules():
            self._shard_module(m)
        init = getattr(root, "_init_weights", None)
        if callable(init):
            _replay_init(root, init, self._built_on)
        return root

    # -- sharding ----------------------------------------------------------------------------------
    def _shard_module(self, m: torch.nn.Module) -> None:
        # Note [meta modules in zero.Init]: a module built on the meta device (`torch.nn.utils.skip_init`
        # builds with device="meta", then `to_empty`) has no values to shard yet; it is sharded when its
        # materialised self is attached to its parent (or at the end of the context).
        params = [p for p in m.parameters(recurse=False) if tags.owner_of(p) is None and not p.is_meta]
        if not params:
            return
        world, rank = comm.get_world_size(self.group), comm.get_rank(self.group)
        device = get_accelerator().torch_device(comm.get_local_rank())  # Note [where zero.Init shards live]
        host = self.remote_device in ("cpu", "nvme") and device.type != "cpu"
        built_on = params[0].device
        values = [p.detach().to(torch.float32) for p in params]
        # a lone contiguous fp32 parameter whose length needs no padding already is the flat buffer:
        # shard it without a copy of the whole (Note [re-partitioning zero.Init in place], strategy.py)
        v = values[0]
        full = (
            v.reshape(-1)
            if (
                len(values) == 1
                and v.is_contiguous()
                and v.device == device
                and padded_size(v.numel(), world) == v.numel()
            )
            else None
        )
        owner = FlatParam(
            -1,
            params,
            values,
            full=full,
            group_index=0,
            world_size=world,
            rank=rank,
            dtype=self.dtype,
            device=device,
            shard_device=torch.device("cpu") if host else device,
            pin=_Pinned() if host and self.pin_memory else None,
            dp_group=self.group,
            trainable=False,
        )
        self._built_on[id(owner)] = built_on
        self._owners.append(owner)
        tags.set_owner(owner)  # strongly: nothing else holds zero.Init's owners (Note [owners held weakly])


class _Pinned:
    """The `pin` FlatParam takes (an OffloadPlan's `pinned`) for zero.Init(pin_memory=True)."""

    @staticmethod
    def pinned(t: torch.Tensor) -> torch.Tensor:
        return get_accelerator().pin_memory(t)


@torch.no_grad()
def _replay_init(root: torch.nn.Module, init_fn, built_on: dict[int, torch.device] | None = None) -> None:
    """Apply `init_fn` to every module in `nn.Module.apply` order (children first), gathering each
    module's parameters around the call. Every rank draws the same random numbers, so each keeps its
    own chunk of the result without any communication.

    The call runs on the device the module was built on (`built_on`, by flat parameter): a model
    built on the host but sharded on a GPU re-initialises from the host generator, as its unsharded
    construction did, not from the GPU's (other numbers, and the host stream would not advance)."""
    built_on = built_on or {}

    def visit(m):
        for child in m.children():
            visit(child)
        owners = {id(o): o for p in m.parameters(recurse=False) if (o := tags.owner_of(p)) is not None}
        was = {k: o.state for k, o in owners.items()}
        for o in owners.values():
            o.wait()
        staged = {k: _stage(o, built_on[k]) for k, o in owners.items() if built_on.get(k, o.device) != o.device}
        init_fn(m)
        for k, o in owners.items():
            if k in staged:
                o.full.copy_(staged[k])
                _point_at(o, o.full)
            o.shard_from_full()
            if was[k] is State.SHARDED:
                o.release()

    visit(root)


def _stage(owner: FlatParam, device: torch.device) -> torch.Tensor:
    """A copy of the gathered `owner` on `device`, with its parameters pointing into it."""
    copy = owner.full.to(device)
    _point_at(owner, copy)
    return copy


def _point_at(owner: FlatParam, full: torch.Tensor) -> None:
    for p, s, shape in zip(owner.params, owner.layout.segments, owner.shapes):
        p.data = full[s.offset : s.offset + s.numel].view(shape)


class GatheredParameters:
    """Inside the block the given stage-3 parameters are full tensors on every rank.

    On exit, with `modifier_rank` set, that rank's (possibly modified) values are broadcast and every
    rank re-shards them; with `modifier_rank=None` any change is discarded. Works for one parameter or
    an iterable; ordinary (unsharded) parameters pass through untouched. `fwd_module` is accepted for
    DeepSpeed compatibility (external parameters are registered with `register_external_parameter`).
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        owners = {}
        for p in params:
            o = tags.owner_of(p)
            if o is not None:
                owners[id(o)] = o
        self.owners = list(owners.values()) if enabled else []
        self.modifier_rank = modifier_rank
        self._was: dict[int, State] = {}

    def __enter__(self):
        for o in self.owners:
            self._was[id(o)] = o.state
            o.wait()
        return self

    @torch.no_grad()
    def __exit__(self, *exc):
        for o in self.owners:
            if self.modifier_rank is not None:
                comm.broadcast(o.full, src=comm.global_rank(o.dp_group, self.modifier_rank), group=o.dp_group)
                o.shard_from_full()
            o.release()
            if self._was[id(o)] is not State.SHARDED:
                o.wait()  # it was resident before: keep it so, with the (kept or discarded) values
        return False


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that `module`'s forward uses `parameter`, owned by another module: stage 3 gathers the
    parameter's unit around `module`'s forward and backward. (A module that registers the parameter
    itself, like a tied output head, needs no declaration.)"""
    tags.add_external(module, parameter)


# DeepSpeed's Init patches torch's tensor constructors (torch.empty, torch.arange, ...) through this
# wrapper, and transformers swaps it while building a model (`prevent_arange_dtype_change`).
# zerospeed's Init builds modules for real and shards each as it is attached (zero/stage3/api.py):
# it patches no constructor, so the wrapper is the identity and swapping it changes nothing.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    return fn
