"""The per-rank peak of a training step, not only model states (pure).

A rank's peak is its model states (`formulas.placed_model_states`) plus what a step allocates on
top, at the moment that sum is largest. The transient terms are the ones the engine really
allocates, each with its own Note below, for a GPT-style decoder (`layout.TransformerShape`: token
and position embeddings, pre-norm blocks of fused qkv / attention out / MLP fc / MLP proj, a final
norm, a language-model head with cross-entropy; `zoo.models.GPT`, transformers' GPT-2)
trained one micro-batch at a time. Every moment adds to base = model states + persistent units:

    forward                   activations + logits                                  + live window
    backward_start            activations + head gradients                          + live window
    backward_first_gradient   activations - head + block working set + tied head grad + live window
                              (- the head's unit at stage 3) + first staging
    backward_buckets          activations - head - blocks behind the buckets + block working set
                              + tied head grad + live window (- the head's unit) + reduce buckets in flight
    step                      max(optimizer temporaries, parameter all-gather staging)

`peak_terms` returns every term (bytes; a negative one is memory freed by that moment), the peak of
each moment, and the moment and the single contribution (a model-state kind or a transient term)
that dominate. Parameters count in the model dtype; gradients, buckets and optimizer temporaries in
fp32 (the engine accumulates in fp32); activations in `act_bytes`. Checked against the allocator's
own record of a real run (tests/dist/test_estimate_peak.py; docs/tools.md has the table).

Note [peak: saved activations]: with torch's scaled_dot_product_attention (flash / memory-efficient
kernels: no s x s probabilities are kept) and no dropout (p = 0 allocates no mask on a CPU), one
block keeps 16*s*b*h elements for backward: its input and the first norm's output (2), the fused
qkv output (3; q, k and v are views of it), the attention output (1), the mid-block residual and the
second norm's output (2), the MLP's fc output and GELU output (4 + 4). That is Korthikanti et al.'s
34*s*b*h bytes in 16-bit without their two dropout masks (2*s*b*h bytes at one byte per element):
32 bytes = 16 elements. Eager attention adds the softmax output, a*s*s*b elements per block; GPT-2's
`gelu_new` (0.5*x*(1 + tanh(...)), composed of elementwise ops) keeps three more 4h-wide tensors
(tanh's output, 0.5*x, 1 + tanh): 12*s*b*h more (`mlp_activation="gelu_new"`). The
model adds the final norm's input and output (2*s*b*h) and the log-probabilities cross-entropy keeps
(s*b*V): the "head" that backward frees first. With full activation checkpointing a block keeps only
its input (s*b*h).

Note [peak: head and backward working set]: while cross-entropy runs, the logits (s*b*V) exist next
to the log-probabilities: the forward's peak. Backward starts with the loss's gradient with respect
to the log-probabilities and to the logits (2*s*b*V) while everything saved is alive; then the
head's weight gradient (V*h, model dtype) is computed next to the logits' gradient: the larger of
the two (at stage 3 the first is freed before the head's backward pre-hook gathers the window, so
the window meets the second only). Later, inside a block's backward, the gradients of the MLP's two
4h-wide intermediates (8*s*b*h) coexist, and with checkpointing that block's recomputed activations
(16*s*b*h); the head is gone by then, and a tied embedding's head gradient (V*h fp32) is buffered by
autograd from the head's backward to the embedding's (both uses must report before the parameter's
gradient is done) — at stages 0-2. At stage 3 it is a reduction unit of its own, launched first
(Note [tied uses], zero/stage3/strategy.py): in flight with its output chunk at the first gradient,
one of the buckets after.
Where the loss casts the logits to fp32 before cross-entropy (`Workload.loss_upcast`; transformers'
ForCausalLMLoss does, whatever the model dtype), the log-probabilities and the loss's two gradients
are fp32 (`loss_bytes`), the forward holds the fp32 copy of the logits next to them, and backward
casts the logits' gradient back to the model dtype next to its fp32 source: max(2*lb, lb + a)*s*b*V
bytes (lb = 4, a = `act_bytes`). In bf16 that is 6*s*b*V bytes more than without the upcast at the
start of backward (measured on a transformers GPT-2 of V 8,192 in bf16: the prediction went from
0.69-0.80 of the allocator's peak to 0.92-0.99 at stages 0-3).

Note [peak: live parameter window]: at stage 3 a unit is gathered in full from its pre-hook to its
release. Units of at most `stage3_param_persistence_threshold` elements (norms, small projections)
stay gathered always: `persistent_parameters`. The head's unit (a tied embedding: for GPT-2, 31% of
the model) stays gathered from the head's forward to the end of the head's backward, then is
released (`head_unit_released`; the embedding's backward reads no weight). Next to it, the units
within the look-ahead (`stage3_prefetch_bucket_size`, capped by Note [buckets bounded by the model],
every unit's size counting as `FetchSchedule` counts it) are resident — prefetched, or kept since a
use nearby — and the last prefetched batch's receive buffer and concatenated send (one block's small
units; Note [large units gather alone]) exist while it is copied out.

Note [peak: reduce buckets]: stages 0-1 accumulate into persistent full-size fp32 buffers (model
states). Stage 2 stages the first layout (~`reduce_bucket_size` elements, capped) from the first
gradient on; stage 3 fuses consecutive units' staging into buckets of the cap (the unit that crosses
it included) and sends their concatenated copy; each collective allocates its output chunk (bucket/N)
and, on gloo's list forms, the backend a copy of it (`collective_copies`; NCCL's tensor forms: 0). A
bucket launches only after the backward of every unit in it, so the blocks behind it have freed their
activations; the moment is taken at the worst launch. With overlap (stage 3's default) up to
MAX_IN_FLIGHT_BUCKETS + 1 buckets exist when one more launches: the term is that bound, an upper
bound (how many are still in flight depends on the network). Without overlap: exactly one.

Note [peak: optimizer temporaries]: torch's single-tensor Adam/AdamW (the CPU default) computes
`exp_avg_sq.sqrt() / bias_correction2_sqrt` per stepped tensor: two temporaries of that tensor's
size, so the peak is twice the largest stepped tensor — the largest parameter at stage 0, the
largest flat chunk at stages 1-3. The foreach form (the CUDA default) keeps one temporary per
element of the whole step at once (a sub-group, `sub_group_size`). An offloaded step runs on the
host in torch's fused CPU kernel (no device temporaries; Note [peak: offload on a CPU-only machine]). After the
step, stages 1-2 all-gather every
layout's updated chunk (up to `allgather_bucket_size` in flight); on gloo each running all-gather
stages its flat output (a layout) in the backend: measured, at most GLOO_STAGED at once.

Note [peak: offload on a CPU-only machine]: where the host is the device (no accelerator; gloo), an
offloaded state is already where offload would put it, and the engine does not copy it: fp32 masters
alias the parameter buffer (zero/flat_group.py), the step reads the gradient partition in place. The
states are then those of the same stage without offload, and only the step changes (the fused CPU
kernel: no temporaries). `EngineKnobs.host_is_device` says so; the device/host split of
`placed_model_states` is what a GPU run holds. Measured (tests/dist/test_estimate_peak.py): with the
split, a CPU-only offload run was predicted 6-23% high (the host's master and gradient copies,
8*P/N bytes, do not exist there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerospeed.config.schema.zero import ZeroConfig
from zerospeed.estimate.formulas import Option, Precision, placed_model_states
from zerospeed.estimate.layout import TransformerShape, layer_modules
from zerospeed.zero.budgets import bounded_budgets
from zerospeed.zero.partition import build_layouts, padded_size
from zerospeed.zero.reducer import MAX_IN_FLIGHT_BUCKETS
from zerospeed.zero.stage3.flat_param import DIRECT_GATHER

_ZERO_DEFAULTS = {name: f.default for name, f in ZeroConfig.model_fields.items()}  # DeepSpeed's, from the schema


@dataclass(frozen=True)
class EngineKnobs:
    """The config keys the transient terms depend on (defaults: the `zero_optimization` schema's)."""

    reduce_bucket_size: int = _ZERO_DEFAULTS["reduce_bucket_size"]
    allgather_bucket_size: int = _ZERO_DEFAULTS["allgather_bucket_size"]
    prefetch_bucket_size: int = _ZERO_DEFAULTS["stage3_prefetch_bucket_size"]
    max_live_parameters: int = _ZERO_DEFAULTS["stage3_max_live_parameters"]
    param_persistence_threshold: int = _ZERO_DEFAULTS["stage3_param_persistence_threshold"]
    model_persistence_threshold: int = _ZERO_DEFAULTS["stage3_model_persistence_threshold"]
    sub_group_size: int = _ZERO_DEFAULTS["sub_group_size"]
    overlap_comm: bool | None = None  # None: stage == 3, as the config's default
    collective_copies: int = 1  # gloo's list-form collectives stage a flat copy; NCCL: 0
    foreach_step: bool = False  # torch's default on a CPU; True on CUDA
    host_is_device: bool = False  # a CPU-only run: Note [peak: offload on a CPU-only machine]

    @classmethod
    def from_config(cls, zero: dict, *, backend: str = "gloo", foreach_step: bool | None = None) -> EngineKnobs:
        """From a `zero_optimization` dict (missing keys: DeepSpeed's defaults)."""
        d = cls()
        pick = lambda key, default: int(zero.get(key, default))
        return cls(
            pick("reduce_bucket_size", d.reduce_bucket_size),
            pick("allgather_bucket_size", d.allgather_bucket_size),
            pick("stage3_prefetch_bucket_size", d.prefetch_bucket_size),
            pick("stage3_max_live_parameters", d.max_live_parameters),
            pick("stage3_param_persistence_threshold", d.param_persistence_threshold),
            pick("stage3_model_persistence_threshold", d.model_persistence_threshold),
            pick("sub_group_size", d.sub_group_size),
            zero.get("overlap_comm"),
            1 if backend == "gloo" else 0,
            backend != "gloo" if foreach_step is None else foreach_step,
            host_is_device=backend == "gloo",
        )


@dataclass(frozen=True)
class Workload:
    """One rank's micro-batch."""

    micro_batch: int
    seq_len: int
    checkpointing: bool = False
    attention: str = "sdpa"  # "sdpa" (no s x s kept) or "eager" (softmax output kept)
    act_bytes: int = 4
    mlp_activation: str = "gelu"  # "gelu" (one op) or "gelu_new" (GPT-2's tanh form, composed of ops)
    loss_upcast: bool = False  # the loss casts the logits to fp32 first (transformers' ForCausalLMLoss)

    @property
    def loss_bytes(self) -> int:
        """Bytes per element of the log-probabilities and the loss's gradients (Note [peak: head and
        backward working set])."""
        return 4 if self.loss_upcast else self.act_bytes


@dataclass(frozen=True)
class Peak:
    """Bytes per rank: the model states, each transient term, the peak of each phase."""

    states: dict[str, float]
    terms: dict[str, float]
    phases: dict[str, float]
    phase_terms: dict[str, tuple[str, ...]] = field(repr=False)

    @property
    def total(self) -> float:
        return max(self.phases.values())

    @property
    def phase(self) -> str:
        return max(PHASES, key=lambda p: self.phases[p])

    def by_phase(self, phase: str) -> dict[str, float]:
        """The transient terms that make up `phase`'s peak (on top of states + persistent)."""
        return {x: self.terms[x] for x in self.phase_terms[phase]}

    @property
    def dominant(self) -> str:
        """The largest single contribution at the peak: a model-state kind or a transient term."""
        parts = {k: v for k, v in self.states.items()}
        parts.update({t: self.terms[t] for t in self.phase_terms[self.phase] if self.terms[t] > 0})
        return max(parts, key=parts.get)


# -- the model's parameters, as the engine lays them out --------------------------------------------
def module_params(shape: TransformerShape) -> list[tuple[str, list[int]]]:
    """(module, its parameters' numels) in registration order: embeddings, blocks, final norm, head."""
    h = shape.hidden
    split = lambda n, bias: [n - bias, bias] if bias else [n]
    mods = [("wte", [shape.vocab * h])] + ([("wpe", [shape.positions * h])] if shape.positions else [])
    bias = h if shape.bias else 0
    block = layer_modules(shape, 1)
    # a block's modules in registration order: norm, attention, norm, MLP
    names = (
        ["norm_1"]
        + [k for k in block if k.startswith("attn.")]
        + ["norm_2"]
        + [k for k in block if k.startswith("mlp.")]
    )
    for i in range(shape.layers):
        for name in names:
            sharded, replicated = block[name]
            n = sharded + replicated
            b = (n // (h + 1) if name in ("attn.qkv", "mlp.fc") else h) if shape.bias else 0
            mods.append((f"{i}.{name}", split(n, b) if not name.startswith("norm") else split(n, bias)))
    mods.append(("ln_f", split(shape.norm_params, bias)))
    if not shape.tied:
        mods.append(("head", [shape.vocab * h]))
    return mods


def stage3_units(shape: TransformerShape, world: int) -> list[int]:
    """Padded elements of each stage-3 unit (one per module owning parameters), in creation order."""
    return [padded_size(sum(ps), world) for _, ps in module_params(shape)]


def grad_layouts(shape: TransformerShape, world: int, bucket: int) -> list[int]:
    """Padded elements of each stage 1-2 flat layout (parameters in reverse order, ~bucket each)."""
    numels = [n for _, ps in module_params(shape) for n in ps]
    return [lay.padded for lay in build_layouts(list(reversed(numels)), bucket, world)]


def persistent_units(units: list[int], knobs: EngineKnobs) -> int:
    """Elements of the stage-3 units kept gathered always (Note [peak: live parameter window])."""
    total = 0
    for n in units:
        if n <= knobs.param_persistence_threshold and total + n <= knobs.model_persistence_threshold:
            total += n
    return total


# -- activations -------------------------------------------------------------------------------------
def saved_activations(shape: TransformerShape, w: Workload) -> float:
    """Elements kept for backward at the end of forward (Note [peak: saved activations])."""
    sbh = w.seq_len * w.micro_batch * shape.hidden
    sbv = w.seq_len * w.micro_batch * shape.vocab * w.loss_bytes / w.act_bytes  # in act_bytes elements
    return shape.layers * _block_saved(shape, w) + 2 * sbh + sbv


def block_working_set(shape: TransformerShape, w: Workload) -> float:
    """Elements a block's backward allocates on top of what was saved: the gradients of its two
    4h-wide MLP intermediates, and with checkpointing its recomputed activations
    (Note [peak: head and backward working set])."""
    sbh = w.seq_len * w.micro_batch * shape.hidden
    return 8 * sbh + (_block_full(shape, w) if w.checkpointing else 0)


def _block_params(shape: TransformerShape) -> int:
    return sum(a + r for a, r in layer_modules(shape, 1).values())


def _block_saved(shape: TransformerShape, w: Workload) -> float:
    sbh = w.seq_len * w.micro_batch * shape.hidden
    return sbh if w.checkpointing else _block_full(shape, w)


def _block_full(shape: TransformerShape, w: Workload) -> float:
    """One block's saved activations without checkpointing (Note [peak: saved activations])."""
    sbh = w.seq_len * w.micro_batch * shape.hidden
    extra_mlp = 3 * 4 * sbh if w.mlp_activation == "gelu_new" else 0
    eager = shape.n_heads * w.seq_len**2 * w.micro_batch if w.attention == "eager" else 0
    return 16 * sbh + extra_mlp + eager


def _fused_buckets(sizes: list[int], cap: int) -> list[int]:
    """Stage 3's reduction buckets in launch order: consecutive units fused until >= cap."""
    out, run = [], 0
    for n in sizes:
        run += n
        if run >= cap:
            out.append(run)
            run = 0
    return out + ([run] if run else [])


def _bucket_moment(
    buckets: list[int], flights: int, per_element: float, shape: TransformerShape, w: Workload
) -> tuple[int, int]:
    """(elements of the buckets in flight, blocks whose backward has run) at the worst launch: `flights`
    consecutive buckets in flight when the last of them launches, which is after the backward of every
    unit in it and before — the head and final norm first, then the blocks from the last — so the blocks
    behind it hold no activations any more (Note [peak: reduce buckets]). The blocks done are counted as
    the elements launched so far over a block's (an approximation: the head's units, and a tied head's
    gradient share, count as blocks too)."""
    best, where = None, (0, 0)
    for i in range(len(buckets)):
        inflight = sum(buckets[i : i + flights])
        done = min(shape.layers, int(sum(buckets[: i + flights]) // max(1, _block_params(shape))))
        value = inflight * per_element - done * _block_saved(shape, w) * w.act_bytes
        if best is None or value > best:
            best, where = value, (inflight, done)
    return where


# -- the peak ----------------------------------------------------------------------------------------
def peak_terms(
    shape: TransformerShape,
    world: int,
    option: Option,
    prec: Precision,
    workload: Workload,
    knobs: EngineKnobs = EngineKnobs(),
) -> Peak:
    """Per-rank peak bytes of a training step at `option` on `world` data-parallel ranks.

    The moments are `PHASE_TERMS` (see the module docstring); terms are bytes, a negative one is
    memory freed by that moment. With parameter offload the shards live on the host, but units are
    gathered on the device as without it."""
    stage, n, pb, a = option.stage, world, prec.param, workload.act_bytes
    mods = module_params(shape)
    params = [x for _, ps in mods for x in ps]
    total = sum(params)
    # Note [peak: offload on a CPU-only machine]
    placed = Option(stage) if knobs.host_is_device else option
    states = placed_model_states(total, n, placed, prec, max(sum(ps) for _, ps in mods))["device"]
    budgets = bounded_budgets(
        total,
        reduce_bucket_size=knobs.reduce_bucket_size,
        prefetch_bucket_size=knobs.prefetch_bucket_size,
        max_reuse_distance=0,
    )
    overlap = stage == 3 if knobs.overlap_comm is None else knobs.overlap_comm
    flights = MAX_IN_FLIGHT_BUCKETS + 1 if overlap else 1
    copies = knobs.collective_copies
    sbh = workload.seq_len * workload.micro_batch * shape.hidden
    sbv = workload.seq_len * workload.micro_batch * shape.vocab
    t: dict[str, float] = dict.fromkeys(TERMS, 0.0)
    t["activations"] = saved_activations(shape, workload) * a
    lb = workload.loss_bytes
    # the logits; where the loss upcasts them, their fp32 copy too while log-softmax runs
    t["logits"] = sbv * a + (sbv * lb if lb != a else 0)
    # the loss's gradients (log-probabilities and logits, in the loss's dtype), then that gradient
    # cast to the model dtype, or later the logits' gradient next to the head weight's gradient being
    # computed (model dtype)
    head_weight_grad = shape.vocab * shape.hidden * pb
    loss_grads = max(2 * lb, lb + a) * sbv
    t["head_gradients"] = max(loss_grads, sbv * a + head_weight_grad)
    t["block_working_set"] = t["block_working_set_at_buckets"] = block_working_set(shape, workload) * a
    t["tied_head_gradient"] = t["tied_head_gradient_at_buckets"] = (
        shape.vocab * shape.hidden * 4.0 if shape.tied else 0.0
    )
    # the final norm's input/output and the log-probabilities
    t["head_freed"] = -(2 * sbh * a + sbv * lb)
    if stage == 3:
        units = stage3_units(shape, n)
        t["persistent_parameters"] = persistent_units(units, knobs) * pb
        live_cap = min(budgets.prefetch_bucket, knobs.max_live_parameters)
        head_unit = 0 if shape.tied else len(units) - 1
        # backward's order of use after the head: the units from the last; the head's unit (the tied
        # embedding) stays gathered until its last use, outside the look-ahead
        order = [i for i in range(len(units) - 1, -1, -1) if i != head_unit]
        window = _live_window([units[i] for i in order], live_cap, knobs.param_persistence_threshold)
        # Note [large units gather alone]: only a block's small units travel in a batch whose receive
        # buffer and concatenated send exist while it is copied out
        small = sum(
            padded_size(sum(ps), n)
            for name, ps in mods
            if name.startswith("0.")
            and padded_size(sum(ps), n) < DIRECT_GATHER
            and padded_size(sum(ps), n) > knobs.param_persistence_threshold
        )
        batch = min(window, small)
        t["live_window"] = (units[head_unit] + window + batch * (1 + 1 / n)) * pb
        # the loss's gradient with respect to the log-probabilities is freed before the head's backward
        # pre-hook gathers the window: the logits' gradient (and the head weight's) meets it; the head's
        # own unit is gathered throughout (from the head's forward to its backward)
        t["head_gradients"] = max(sbv * a + head_weight_grad, loss_grads - (t["live_window"] - units[head_unit] * pb))
        launches = units[::-1]
        if shape.tied:  # Note [tied uses]: the head's share of the tied gradient is a unit of its own,
            # launched first and reduced at once, and the embedding's unit is released after the head
            launches = [units[0]] + launches
            t["tied_head_gradient"] = units[0] * 4.0 * (1 + (1 + copies) / n) if n > 1 else units[0] * 4.0
            t["tied_head_gradient_at_buckets"] = 0.0
            t["head_unit_released"] = -units[0] * pb
        buckets = _fused_buckets(launches, budgets.reduce_bucket)
        # per bucket: the units' staging and its concatenated copy, then the copy, the output chunk
        # (+ the backend's copy of it)
        per = max(2.0, 1 + (1 + copies) / n) * 4.0
        inflight, done = _bucket_moment(buckets, flights, per, shape, workload)
        t["reduce_buckets"] = inflight * per if n > 1 else 0.0
        t["blocks_freed_before_buckets"] = -done * _block_saved(shape, workload) * a
        t["live_window_at_buckets"] = t["live_window"]
        if done == shape.layers:  # the buckets launch after the embedding's backward: no block's working
            # set, the tied gradient delivered, only the head's unit still gathered (an untied head)
            t["block_working_set_at_buckets"] = t["tied_head_gradient_at_buckets"] = 0.0
            t["live_window_at_buckets"] = units[head_unit] * pb
        chunk = max(units) / n
    elif stage in (1, 2):
        layouts = grad_layouts(shape, n, budgets.reduce_bucket)
        chunk = max(layouts) / n
        if stage == 2 and n > 1:  # the layout's staging is the send; its output chunk (+ the backend's copy)
            t["first_staging"] = layouts[0] * 4.0
            per = (1 + (1 + copies) / n) * 4.0
            inflight, done = _bucket_moment(layouts, flights, per, shape, workload)
            t["reduce_buckets"] = inflight * per
            t["blocks_freed_before_buckets"] = -done * _block_saved(shape, workload) * a
            if done == shape.layers:
                t["block_working_set_at_buckets"] = t["tied_head_gradient_at_buckets"] = 0.0
        if n > 1:
            t["allgather_staging"] = _in_flight(layouts, knobs.allgather_bucket_size, GLOO_STAGED) * pb * copies
    else:
        chunk = max(params)
    stepped = min(total / (n if stage else 1), knobs.sub_group_size)
    # Note [peak: optimizer temporaries]; an offloaded step runs on the host with torch's fused CPU
    # Adam (optim/sub_group_step.use_fused_cpu_step), which allocates no temporaries of the device's
    t["optimizer_temporaries"] = (
        0.0 if option.offload_optimizer else (stepped if knobs.foreach_step else 2 * chunk) * 4.0
    )
    base = sum(states.values()) + t["persistent_parameters"]
    phases = {
        p: base + (sum(t[x] for x in ts) if p != "step" else max(t[x] for x in ts)) for p, ts in PHASE_TERMS.items()
    }
    return Peak(states, t, phases, PHASE_TERMS)


TERMS = (
    "activations",
    "logits",
    "head_gradients",
    "block_working_set",
    "tied_head_gradient",
    "head_freed",
    "head_unit_released",
    "first_staging",
    "blocks_freed_before_buckets",
    "block_working_set_at_buckets",
    "tied_head_gradient_at_buckets",
    "live_window_at_buckets",
    "persistent_parameters",
    "live_window",
    "reduce_buckets",
    "optimizer_temporaries",
    "allgather_staging",
)
# Note [peak: optimizer temporaries]: measured on gloo (tests/dist/test_estimate_peak.py, the allocator's
# record): at most three layout-sized flat outputs exist at once, however many all-gathers were issued
# (gloo runs a group's collectives on a few worker threads; the count is measured, not derived).
GLOO_STAGED = 3
PHASE_TERMS = {
    "forward": ("activations", "logits", "live_window"),
    "backward_start": ("activations", "head_gradients", "live_window"),
    "backward_first_gradient": (
        "activations",
        "head_freed",
        "block_working_set",
        "tied_head_gradient",
        "live_window",
        "head_unit_released",
        "first_staging",
    ),
    "backward_buckets": (
        "activations",
        "head_freed",
        "blocks_freed_before_buckets",
        "block_working_set_at_buckets",
        "tied_head_gradient_at_buckets",
        "live_window_at_buckets",
        "head_unit_released",
        "reduce_buckets",
    ),
    "step": ("optimizer_temporaries", "allgather_staging"),
}
PHASES = tuple(PHASE_TERMS)


def _live_window(order: list[int], budget: int, persistent_below: int) -> int:
    """Elements of the non-persistent units gathered at once along `order`: the units within `budget`
    elements of the current one (every unit's size counts toward the budget, as FetchSchedule's
    look-ahead does; the ones a recent use kept gathered are resident just as prefetched ones)."""
    window = cum = 0
    for n in order:
        cum += n
        if cum > budget and window:
            break
        if n > persistent_below:
            window += n
    return window


def _in_flight(layouts: list[int], bucket: int, most: int) -> int:
    """The most elements of at most `most` consecutive layouts in flight under `bucket` (at least one)."""
    best = 0
    for i in range(len(layouts)):
        run = 0
        for k, n in enumerate(layouts[i:]):
            if k == most or (run and run + n > bucket):
                break
            run += n
        best = max(best, run)
    return best


def precision_for_peak(dtype: str, optimizer: str = "adamw") -> Precision:
    """zerospeed's precision: fp32 gradient accumulation whatever the model dtype."""
    return Precision.of(dtype, optimizer, grad_dtype="fp32")


__all__ = [
    "EngineKnobs",
    "PHASES",
    "Peak",
    "TERMS",
    "Workload",
    "block_working_set",
    "module_params",
    "peak_terms",
    "persistent_units",
    "precision_for_peak",
    "saved_activations",
    "stage3_units",
]
