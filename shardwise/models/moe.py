"""Mixture-of-experts feed-forward: token-choice top-k routing, grouped-GEMM SwiGLU experts,
optional shared expert, and load balancing by auxiliary loss or by a routing bias.

Routing (per token): scores = softmax or sigmoid of the router logits over the experts; the top-k
experts are chosen by ``score + expert_bias`` (the bias only steers the choice, it never scales an
output: DeepSeek-V3's auxiliary-loss-free balancing), and each chosen expert's output is weighted by
its score (renormalized over the k chosen when ``moe_route_norm``, times ``moe_route_scale``).
Dispatch is capacity-free: no token is dropped, experts take whatever they are sent.

Load balancing, ``moe_balance``:

- ``aux_loss``: the sequence-wise balance loss ``coef * E * sum_e f_e * P_e`` per sequence, with
  ``f_e`` the fraction of the sequence's k*S routing slots that went to expert ``e`` and ``P_e`` the
  mean router score of ``e`` over the sequence, averaged over the sequences of the global batch. Per
  sequence (not per micro-batch) so that it is the same number whatever the data-parallel split or
  accumulation; when a sequence is split over ranks (context / tensor-sequence parallel) the counts
  behind ``f_e`` are all-reduced over those ranks, and each rank's share of ``sum P_e`` is a plain
  partial sum, reduced like every other gradient. The loss enters the backward through
  :class:`AuxLossGrad` (its gradient is injected at the routed experts' output), so it works unchanged
  under pipeline parallel where only the last stage sees the language-model loss.
  ``moe_aux_scope=batch``: the same loss once over the whole batch (Switch Transformer, Mixtral,
  Megatron's global loss): ``f_e`` the share of all k*T slots of the forward on every rank (the
  counts all-reduced over dp x cp x tp), ``P_e`` the mean score over those T tokens -- balance over
  the batch, leaving any one sequence free to favour its experts. One forward per rank per step (no
  accumulation, no pipeline) makes that the global batch, the same whatever the data-parallel split;
  with M micro-batches per step it is the mean over the M forwards of their loss, each over the
  micro-batch's tokens on every rank, so a layout with another M trains a slightly different loss.
- ``bias``: after each optimizer step every expert's bias moves by ``moe_bias_rate`` towards
  balance (``+rate`` if the expert got fewer tokens than the mean over the global batch, ``-rate``
  if more) -- :func:`update_expert_bias`. ``moe_bias_update=proportional``: by the rate times the
  expert's load error relative to the mean, ``(mean - count) / mean`` (the Loss-Free Balancing
  paper's variant): its step is large where the imbalance is and shrinks near balance.
- ``bias+aux_loss``: both (DeepSeek-V3: the bias balances, a small sequence-wise loss -- its
  alpha 1e-4 -- keeps any one sequence from piling onto a few experts).
- ``none``.

Independently, ``moe_z_coef`` adds ST-MoE's router z-loss, the mean over the step's tokens of
``logsumexp(logits)^2``, through the routing weights' backward.

Tensors are (T, dim) for the flattened tokens of the micro-batch, T = B*S local.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config.model_args import ModelArgs
from shardwise.models.layers import FeedForward
from shardwise.ops.autocast import autocast_dtype, compute_dtype
from shardwise.ops.cpu_bf16 import fp32_gemms_for_bf16


class AuxLossGrad(torch.autograd.Function):
    """Identity on ``x`` whose backward also sends gradient 1 into ``aux`` (a scalar loss term
    already scaled by its weight): the auxiliary loss joins the backward of whatever loss ``x``
    feeds, without being returned through the model."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


@torch.library.custom_op("shardwise::count_routed", mutates_args=("total",))
def count_routed(total: torch.Tensor, counts: torch.Tensor) -> None:
    """Add a forward's routed slots per expert ``counts`` (E,) to ``total`` (E,) -- unless this
    forward is activation checkpointing's recompute inside backward, so each token counts once. An
    opaque op: a compiled block runs it as it is, where reading the autograd task in Python would
    split the block's graph (three graph breaks per MoE block, each a trip back to the host)."""
    if torch._C._current_graph_task_id() == -1:
        total.add_(counts.to(total.dtype))


@count_routed.register_fake
def _(total: torch.Tensor, counts: torch.Tensor) -> None:
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (N, a), grouped in order by ``counts`` (G,), times their group's ``w[g]``
    (G, a, b) -> (N, b). ``torch._grouped_mm`` where it exists and takes these shapes (it needs
    16-byte aligned rows), a loop over the groups otherwise."""
    if x.device.type == "meta":  # shapes only (building / planning on meta): (N, a) x (G, a, b)
        return torch.einsum("na,gab->nb", x, w)
    aligned = all(n * x.element_size() % 16 == 0 for n in (w.shape[1], w.shape[2]))
    # fp32 on a CPU, eagerly: its meta kernel, which torch.compile traces, takes bf16 only (as CUDA)
    fp32 = x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling()
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and fp32_gemms_for_bf16() and \
            not torch.compiler.is_compiling():  # (as the bf16 mm of shardwise.ops.cpu_bf16)
        return grouped_mm(x.float(), w.float(), counts).to(torch.bfloat16)
    if hasattr(torch, "_grouped_mm") and aligned and (x.dtype == torch.bfloat16 or fp32):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    sizes = counts.tolist()
    # bmm, not mm: activation checkpointing's selective_half counts the linear layers' mm calls
    outs = [torch.bmm(xi[None], w[g][None])[0] for g, xi in enumerate(torch.split(x, sizes))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[2])


CPU_GROUP_ROWS = 64
"""Fewest rows a CPU expert group is padded to a multiple of, once the groups average that many.
oneDNN builds (JIT-compiles) a kernel for every new GEMM shape and keeps them in a shape-keyed cache
(capped, :func:`shardwise.runtime.machine.bound_matmul_caches`). Routing gives each expert a new row
count at almost every call, so unpadded every grouped GEMM rebuilds its kernels, many times the
product's own cost; padded, the shapes repeat and the kernels are reused (BENCHMARKS.md, MoE on
CPU)."""


def group_alignment(slots: int, n_experts: int) -> int:
    """Rows each expert's group is padded to a multiple of, on CPU: ``CPU_GROUP_ROWS``, or a
    sixteenth of the mean group (a power of two) when that is more, so that the number of distinct
    group sizes -- and so of GEMM shapes -- stays near 32 per expert whatever the token count, while
    the padding adds about 1/32 of the rows. Groups averaging fewer rows pad to the mean's power of
    two: their sizes are few already, and 64 would multiply them (256 experts taking one slot each
    of a 32-token micro-batch, padded to 64: 64x the rows, 11x the grouped GEMMs' time)."""
    mean = max(1, slots // max(1, n_experts))
    floor = min(CPU_GROUP_ROWS, 1 << (mean.bit_length() - 1))
    return max(floor, 1 << max(0, (mean // 16).bit_length() - 1))


def pad_groups(x: torch.Tensor, counts: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                        torch.Tensor]:
    """Rows of ``x`` (N, dim) grouped by ``counts`` (G,) copied into zero-padded groups of a multiple
    of ``align`` rows -> (padded x (N_pad, dim), padded counts (G,), each row's index in it (N,))."""
    padded = (counts + align - 1) // align * align  # (G,)
    shift = torch.cumsum(padded - counts, 0) - (padded - counts)  # (G,) padding before each group
    index = torch.arange(x.shape[0], device=x.device) + torch.repeat_interleave(shift, counts)  # (N,)
    n_pad = int(padded.sum())  # (a host sync: CPU only)
    # (index_put, not index_copy: index_copy's backward keeps the whole source for its shape)
    return x.new_zeros(n_pad, x.shape[1]).index_put((index,), x), padded, index


def pads_groups(x: torch.Tensor) -> bool:
    """Whether the expert groups of rows ``x`` are padded (:data:`CPU_GROUP_ROWS`): on a CPU only."""
    return x.device.type == "cpu" and x.shape[0] > 0


def swiglu_groups(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
    """SwiGLU of rows ``x`` (N, dim), grouped in order by ``counts`` (G,), through their group's
    weights w1, w3 (G, dim, hidden), w2 (G, hidden, dim) -> (N, dim). On CPU each group's rows are
    padded to a multiple of :func:`group_alignment` (zero rows: their outputs are dropped, their
    gradients are zero)."""
    index = None
    if pads_groups(x):
        x, counts, index = pad_groups(x, counts, group_alignment(x.shape[0], counts.numel()))
    h = F.silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts)  # (N, hidden)
    out = grouped_mm(h, w2, counts)  # (N, dim)
    return out if index is None else out.index_select(0, index)


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts as 3-D weights: w1, w3 (n, dim, hidden), w2 (n, hidden, dim)."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        # (the computation, replaceable: simulated ranks run it on each rank's own groups, whose
        # sizes differ by rank: shardwise/trainer/simulate.py)
        self.groups: Callable[..., torch.Tensor] = swiglu_groups

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, dim) sorted by expert, counts (n_local,) tokens per expert -> (N, dim)."""
        # Under expert parallel the weights are DTensors sharded over experts and the tokens have
        # already been exchanged: this rank runs its own experts on plain local tensors.
        # (in x's dtype: under autocast the MoE cast the tokens before its gather; autocast skips
        # grouped GEMMs)
        w1, w2, w3 = (_local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        return self.groups(x, counts, w1, w2, w3)


class Router(nn.Module):
    """Token-choice top-k gate."""

    def __init__(self, dim: int, n_experts: int, top_k: int, score: str, route_norm: bool,
                 route_scale: float, n_groups: int = 1, topk_groups: int = 1) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.top_k, self.score, self.route_norm, self.route_scale = top_k, score, route_norm, route_scale
        self.n_groups, self.topk_groups = n_groups, topk_groups
        # Balancing bias for the choice only (DeepSeek-V3); a persistent buffer, so checkpointed.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
                = None, z_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim) -> (weights (T, k), expert ids (T, k), scores (T, E)); fp32 scores.
        ``choose(biased scores, own top-k) -> ids`` may route elsewhere (a routing trace's replay).
        ``z_weight`` > 0: the z-loss ``z_weight * sum over the tokens of logsumexp(logits)^2`` joins
        the backward through the weights (every chosen weight scales an expert output, so its
        gradient always runs)."""
        # fp32 scores whatever the precision (as Megatron's and DeepSeek-V3's routers): in bf16 the
        # logits round to 2^-8 of their size, so near-ties -- and the balance the choice steers by --
        # would be decided by rounding. (The weight may arrive bf16-rounded from FSDP; the product
        # and its output stay fp32.)
        with torch.autocast(x.device.type, enabled=False) if autocast_dtype(x) else contextlib.nullcontext():
            logits = F.linear(x.float(), self.gate.weight.float())  # (T, E)
        scores = torch.sigmoid(logits) if self.score == "sigmoid" else torch.softmax(logits, dim=-1)
        biased = scores + self.expert_bias
        # The choice carries no gradient: made on detached scores, its ops save nothing for backward.
        _, ids = torch.topk(self.group_limited(biased.detach()), self.top_k, dim=-1)  # (T, k)
        if choose is not None:
            ids = choose(biased, ids)
        weights = scores.gather(-1, ids)
        if self.route_norm:
            weights = weights / weights.sum(-1, keepdim=True)
        if z_weight > 0:
            weights = AuxLossGrad.apply(weights, z_weight * torch.logsumexp(logits, dim=-1).square().sum())
        return weights * self.route_scale, ids, scores

    def group_limited(self, biased: torch.Tensor) -> torch.Tensor:
        """``biased`` (T, E) with every expert outside the token's ``topk_groups`` best groups set to
        -inf (DeepSeek-V3's node-limited routing: a group is ranked by the sum of its two best
        scores). The identity with one group."""
        if self.n_groups == 1:
            return biased
        t, e = biased.shape
        grouped = biased.view(t, self.n_groups, e // self.n_groups)  # (T, G, E/G)
        rank = grouped.topk(min(2, e // self.n_groups), dim=-1).values.sum(-1)  # (T, G)
        best = rank.topk(self.topk_groups, dim=-1).indices  # (T, g)
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)  # (T, G)
        return biased.masked_fill(~keep.repeat_interleave(e // self.n_groups, dim=1), float("-inf"))

    def choice_gap(self, biased: torch.Tensor, own: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """How far the choice ``other`` (T, k) is from being this router's own choice ``own`` on
        ``biased`` (T, E): 0 when it is one (a tie), inf when the rule can never make it, else the
        score margin each stage of the rule decided by. With groups, a token's stages are the group
        choice and then the experts within the chosen groups; the gap is the least, over the group
        sets that hold ``other``'s experts, of the set's rank margin (the own groups' ranks minus the
        set's) plus the experts' margin within it (its top-k scores minus ``other``'s). A group rank
        near-tie can swap experts whose own scores are far apart, so a flat score difference would
        call a rounding tie a gross one."""
        other_sum = biased.gather(-1, other).sum(-1)  # (T,)
        if self.n_groups == 1:
            return biased.gather(-1, own).sum(-1) - other_sum
        t, e = biased.shape
        size = e // self.n_groups
        rank = biased.view(t, self.n_groups, size).topk(min(2, size), dim=-1).values.sum(-1)  # (T, G)
        best = rank.topk(self.topk_groups, dim=-1).values.sum(-1)  # (T,)
        needed = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, other // size, True)  # (T, G)
        gap = torch.full_like(other_sum, float("inf"))
        for groups in itertools.combinations(range(self.n_groups), self.topk_groups):  # (a debug path)
            in_set = torch.zeros(self.n_groups, dtype=torch.bool, device=biased.device)
            in_set[list(groups)] = True
            within = biased.masked_fill(~in_set.repeat_interleave(size), float("-inf"))  # (T, E)
            experts = within.topk(self.top_k, dim=-1).values.sum(-1) - other_sum  # (T,) within the set
            margin = best - rank[:, in_set].sum(-1) + experts
            holds = ~(needed & ~in_set).any(-1)  # (T,) the set holds other's groups
            gap = torch.where(holds, torch.minimum(gap, margin), gap)
        return gap


class MoE(nn.Module):
    """Routed experts (+ an optional shared expert) in place of the dense feed-forward."""

    def __init__(self, args: ModelArgs, sequences_per_step: int = 1,
                 sequence_group: dist.ProcessGroup | None = None, layer_id: int = 0,
                 batch_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id  # (the model's block index: loads are reported per block)
        self.n_experts, self.top_k = args.n_experts, args.moe_top_k
        self.balance_loss, self.balance_bias = args.balance_loss, args.balance_bias
        self.aux_coef, self.bias_rate = args.moe_aux_coef, args.moe_bias_rate
        self.aux_scope = args.moe_aux_scope
        self.bias_proportional = args.moe_bias_update == "proportional"
        self.z_coef = args.moe_z_coef
        self.router = Router(args.dim, args.n_experts, args.moe_top_k, args.moe_score,
                             args.moe_route_norm, args.moe_route_scale, args.moe_n_groups,
                             args.moe_topk_groups)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.moe_hidden_dim)
        self.shared_expert = None
        if args.n_shared_experts:
            self.shared_expert = FeedForward(args.dim, args.n_shared_experts * args.moe_hidden_dim)
        # Tokens routed to each expert since the last bias update (all micro-batches of a step).
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        # The global number of sequences per step (the balance loss is a mean over them) and the
        # group of ranks that share a sequence (cp x tp), if any: its statistics sum over them.
        self.sequences_per_step, self.sequence_group = sequences_per_step, sequence_group
        self.batch_group = batch_group  # every rank routing other tokens (dp x cp x tp): batch scope
        self.count_tokens = True  # off while a forward is not training (pipeline shape inference)
        self.routing = None  # a RoutingTrace (shardwise/observe/routing.py) records or replays routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)  # (T, dim)
        trace = self.routing if self.count_tokens and self.training and torch.is_grad_enabled() else None
        choose = functools.partial(trace.choose, self) if trace is not None else None
        training = self.training and torch.is_grad_enabled()  # not evaluation
        z_weight = 0.0
        if training and self.z_coef > 0:  # a mean over the step's tokens: this rank's share of them
            z_weight = self.z_coef / self.step_tokens(s)
        weights, ids, scores = self.router(tokens, choose, z_weight)  # (T, k), (T, k), (T, E)
        flat_ids = ids.flatten()  # (T*k,)
        # (E,) slots per expert; scatter_add rather than bincount, which has no meta kernel
        counts = flat_ids.new_zeros(self.n_experts).scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        if training and self.count_tokens:  # (not in a checkpointed block's recompute: count_routed)
            with torch.no_grad():
                count_routed(self.tokens_per_expert, counts)
        aux = None
        if training and self.balance_loss:
            # Computed before the experts so the block's last ops are the experts' (activation
            # checkpointing then need not recompute past the shared expert's down projection).
            aux = self.aux_loss(ids.view(b, s, -1), scores.view(b, s, -1))
        order = torch.argsort(flat_ids, stable=True)  # routing slots grouped by expert
        # (index_select: its backward is an index_add, about twice as fast on CPU as indexing's)
        # cast before the gather (autocast's dtype, if on): k copies of each token move at half width
        routed = tokens.to(compute_dtype(tokens)).index_select(0, order // self.top_k)  # (T*k, dim)
        out = self.experts(routed, counts)  # (T*k, dim)
        out = out * weights.flatten()[order, None].to(out.dtype)
        if aux is not None:  # (every slot's output reaches y, so its gradient always runs)
            out = AuxLossGrad.apply(out, aux)
        # The module's output is a tensor of its own, not a view: FSDP2 warns on every step of a
        # wrapped module that returns one.
        y = x.new_zeros(x.shape, dtype=out.dtype)  # (B, S, dim); x's dtype unless under autocast
        y.view(-1, dim).index_add_(0, order // self.top_k, out)
        if self.shared_expert is not None:
            y = y + self.shared_expert(tokens).view(b, s, dim)
        return y

    def step_tokens(self, local_len: int) -> int:
        """Tokens of the whole step on every rank, from this rank's sequence length ``local_len``
        (a sequence split over cp x tp holds that many on each of them)."""
        split = dist.get_world_size(self.sequence_group) if self.sequence_group is not None else 1
        return self.sequences_per_step * local_len * split

    def aux_loss(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """This rank's part of coef * mean over the step's sequences of E * sum_e f_e P_e (or of
        coef * E * sum_e f_e P_e over the batch: ``aux_scope``).

        ids (B, S, k), scores (B, S, E), S local. Only P carries gradient; f is a count."""
        if self.aux_scope == "batch":
            return self.batch_aux_loss(ids, scores)
        e, k = self.n_experts, self.top_k
        with torch.no_grad():
            counts = F.one_hot(ids, e).sum(dim=(1, 2)).float()  # (B, E) slots per expert
            local_len = torch.full_like(counts[:, :1], ids.shape[1])  # (B, 1) tokens here
            stats = torch.cat([counts, local_len], dim=1)  # (B, E + 1)
            if self.sequence_group is not None:  # one all-reduce over the ranks sharing a sequence
                dist.all_reduce(stats, group=self.sequence_group)
            seq_counts, seq_len = stats[:, :e], stats[:, e:]  # (B, E), (B, 1): whole sequences
            f = seq_counts / (k * seq_len)  # (B, E)
        scores = scores / scores.sum(-1, keepdim=True)  # sigmoid scores normalized to sum 1
        p_sum = scores.sum(dim=1)  # (B, E): this rank's part of S * P_e
        per_seq = e * (f * p_sum / seq_len).sum(-1)  # (B,) partial over the sequence group
        return self.aux_coef * per_seq.sum() / self.sequences_per_step

    def batch_aux_loss(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """This rank's part of coef * E * sum_e f_e P_e over the forward's tokens on every rank,
        weighted by their share of the step's tokens (1 without micro-batches)."""
        e, k = self.n_experts, self.top_k
        with torch.no_grad():
            # (E + 1,): this rank's slots per expert, then its tokens; scatter_add, not a (slots, E) one-hot
            stats = torch.zeros(e + 1, device=ids.device)
            stats.scatter_add_(0, ids.flatten(), torch.ones(ids.numel(), device=ids.device))
            stats[e] = ids.shape[0] * ids.shape[1]
            if self.batch_group is not None:  # one all-reduce over every rank routing other tokens
                dist.all_reduce(stats, group=self.batch_group)
            f = stats[:e] / (k * stats[e])  # (E,) the forward's shares over every rank
            step_tokens = self.step_tokens(ids.shape[1])
        scores = scores / scores.sum(-1, keepdim=True)  # sigmoid scores normalized to sum 1
        # sum over this rank's tokens of the scores over the step's tokens: the rank's part of P_e,
        # times the forward's share of the step (the other ranks' parts join in the gradient's sum)
        p_part = scores.sum(dim=(0, 1)) / step_tokens  # (E,)
        return self.aux_coef * e * (f * p_part).sum()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@contextlib.contextmanager
def routing_not_counted(model: nn.Module) -> Iterator[None]:
    """Forwards inside do not count towards the experts' token loads (bias update, load metric)."""
    layers = moe_layers(model)
    for m in layers:
        m.count_tokens = False
    try:
        yield
    finally:
        for m in layers:
            m.count_tokens = True


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None) -> dict[int, torch.Tensor]:
    """After an optimizer step: move each router's bias towards balance (``moe_balance=bias``),
    reset the token counts, and return the step's expert load of each MoE block this model (or
    pipeline stage) holds, by block index: its busiest expert's routed slots over the mean (1.0 =
    perfectly balanced; top-k of E experts: at most E/k). Empty for a dense model or stage.

    ``group``: every rank that routes different tokens (dp x cp x tp); the counts are summed over it
    so every rank applies the same update, whatever the layout."""
    layers = moe_layers(model)
    if not layers:
        return {}
    counts = torch.stack([m.tokens_per_expert for m in layers])  # (L_moe, E)
    if group is not None:
        dist.all_reduce(counts, group=group)
    mean = counts.mean(-1, keepdim=True).clamp(min=1e-9)  # (L_moe, 1)
    errors = (mean - counts) / mean  # (L_moe, E) > 0: fewer tokens than the mean
    for m, error in zip(layers, errors, strict=True):
        if m.balance_bias:
            m.router.expert_bias += m.bias_rate * (error if m.bias_proportional else torch.sign(error))
        m.tokens_per_expert.zero_()
    loads = counts.max(-1).values / mean.squeeze(-1)  # (L_moe,)
    return {m.layer_id: load for m, load in zip(layers, loads, strict=True)}
