"""Note [parameter tags] (zerospeed/zero/tags.py): the facts ZeRO reads about a parameter travel with it,
in one tag, with the lifetimes of Note [owners held weakly] — checked against plain Python and torch
(identity, `copy.deepcopy`, `torch.save`/`torch.load`, the garbage collector), no processes."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import torch
from torch import nn

from zerospeed.moe.experts import Experts
from zerospeed.moe.utils import is_autoep_expert_param, is_moe_param
from zerospeed.zero import tags


class _Owner:
    """What the tag needs of a stage-3 owner (a FlatParam): its parameters and their full shapes."""

    def __init__(self, params, shapes):
        self.params, self.shapes = params, shapes


def test_expert_tags_follow_copies_and_pickles():
    experts = Experts(nn.Linear(4, 4), num_local_experts=2, expert_group_name="ep_size_2")
    params = list(experts.parameters())
    assert [tags.expert_group(p) for p in params] == ["ep_size_2"] * 4
    assert all(is_moe_param(p) and not is_autoep_expert_param(p) for p in params)
    clone = copy.deepcopy(experts)  # a parameter's deep copy has no attributes: the container tags it again
    assert all(tags.expert_group(p) == "ep_size_2" for p in clone.parameters())
    assert not any(q is p for q in clone.parameters() for p in params)

    buf = io.BytesIO()
    torch.save({"w": params[0]}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["w"]
    assert tags.expert_group(loaded) == "ep_size_2" and torch.equal(loaded, params[0])


def test_dense_and_deepspeed_tagged_parameters():
    dense = nn.Parameter(torch.zeros(3))
    assert tags.expert_group(dense) is None and tags.tag_of(dense) is None and not is_moe_param(dense)
    theirs = nn.Parameter(torch.zeros(3))
    theirs.allreduce, theirs.group_name = False, "ep_size_4"  # DeepSpeed's own expert attributes
    assert tags.expert_group(theirs) == "ep_size_4"
    autoep = nn.Parameter(torch.zeros(3))
    tags.mark_expert(autoep, "ep_size_2", autoep=True)
    assert is_autoep_expert_param(autoep) and tags.expert_group(autoep) == "ep_size_2"


def test_owner_full_shape_and_the_pickle_drops_runtime_state():
    a, b = nn.Parameter(torch.empty(0)), nn.Parameter(torch.empty(0))  # sharded: nothing local
    owner = _Owner([a, b], [torch.Size([2, 3]), torch.Size([5])])
    tags.set_owner(owner)
    assert tags.owner_of(a) is owner and tags.full_shape(b) == (5,) and tags.full_numel(a) == 6
    plain = nn.Parameter(torch.zeros(4, 2))
    assert tags.owner_of(plain) is None and tags.full_shape(plain) == (4, 2) and tags.full_numel(plain) == 8
    restored = copy.deepcopy(tags.tag_of(a))  # the pickle protocol: durable facts only
    assert restored.owner is None and restored.index == -1
    tags.clear_owner(a)
    assert tags.owner_of(a) is None and tags.full_shape(a) == (0,)


def test_owner_lifetimes():
    # held elsewhere (an engine's flat parameter): the tag does not keep it alive
    p = nn.Parameter(torch.zeros(2))
    owner = _Owner([p], [torch.Size([2])])
    tags.set_owner(owner, held_elsewhere=True)
    gone = weakref.ref(owner)
    del owner
    assert gone() is None and tags.owner_of(p) is None

    # held by the tag only (zero.Init's): alive with its parameter, collected with it
    q = nn.Parameter(torch.zeros(1 << 16))
    owner = _Owner([q], [torch.Size([1 << 16])])
    tags.set_owner(owner)
    owner_ref, param_ref = weakref.ref(owner), weakref.ref(q)
    del owner
    assert tags.owner_of(q) is owner_ref()
    del q
    gc.collect()
    assert owner_ref() is None and param_ref() is None


def test_trainer_and_leaf_are_weak():
    p = nn.Parameter(torch.zeros(2))
    strategy, leaf = _Owner([], []), nn.Linear(1, 1)
    tags.set_trainer([p], strategy)
    tags.set_leaf_module(p, leaf)
    assert tags.trainer_of(p) is strategy and tags.leaf_module_of(p) is leaf
    del strategy, leaf
    assert tags.trainer_of(p) is None and tags.leaf_module_of(p) is None


def test_externals_live_on_the_module_and_follow_a_deep_copy():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    tags.add_external(model[1], model[0].weight)
    tags.add_external(model[1], model[0].weight)  # declared twice: used once
    assert tags.externals(model[1]) == [model[0].weight] and tags.externals(model[0]) == []
    clone = copy.deepcopy(model)
    assert len(tags.externals(clone[1])) == 1 and tags.externals(clone[1])[0] is clone[0].weight
