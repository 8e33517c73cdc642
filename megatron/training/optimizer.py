"""AdamW over fp32 main parameters, sharded over data parallel with --use-distributed-optimizer.

The main parameters are slices of one flat fp32 buffer: the model's own parameter buffer when the
model is fp32, an fp32 copy of the ranges this rank owns when it is bf16 (Megatron's mixed
precision; sharded, each rank holds 1/dp of it, as megatron-core's distributed optimizer). The
optimizer sees the pieces of parameters inside the flat ranges this rank owns (all of them, unless
sharded), so the unsharded optimizer is the sharded one with one shard: one code path.

Norms and zero counts follow Megatron: a parameter replicated over tp ranks is counted on tp rank 0
only; sums are completed over the shard group (dp, when sharded) and the model-parallel group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.training.distributed import PARAM_ALIGN, GradBuffer, round_up
from megatron.training.loss_scaler import LossScaler


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's default: biases and 1-D parameters (norm weights) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


# Parameter groups by (weight decay, own learning rate), in a fixed order.
GROUP_ORDER = ((True, False), (False, False), (True, True), (False, True))


def group_key(name: str, param: torch.Tensor, args) -> tuple:
    """The (weight decay, own learning rate) group of a model parameter."""
    decoupled = getattr(args, "decoupled_lr", None) is not None
    own_lr = decoupled and getattr(param, "is_embedding_or_output_parameter", False)
    return not no_weight_decay(name, param), own_lr


def param_group(params, decay: bool, own_lr: bool, args) -> dict:
    """wd_mult is what megatron-core's LR scheduler multiplies the weight decay by; max_lr and
    min_lr, when present, replace the schedule's (--decoupled-lr for the embedding and output layer,
    megatron-core's `is_embedding_or_output_parameter`)."""
    group = {"params": params, "wd_mult": 1.0 if decay else 0.0, "weight_decay": args.weight_decay if decay else 0.0}
    if own_lr:
        group["max_lr"] = args.decoupled_lr
        group["min_lr"] = args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr
    return group


def fused_adamw(device: torch.device) -> Optional[bool]:
    """torch's fused AdamW on CUDA: one kernel pass over every tensor, where the multi-tensor path
    takes several (Megatron runs Transformer Engine's or apex's fused Adam); torch's default
    elsewhere."""
    return True if device.type == "cuda" else None


def _packed(ranges) -> List[Tuple[int, int, int]]:
    """(start, end, where it begins) of ranges laid one after another in their order, each from a
    multiple of PARAM_ALIGN elements (a shard can be any length: lcm(dp, 128) / dp elements)."""
    out, at = [], 0
    for lo, hi in ranges:
        out.append((lo, hi, at))
        at = round_up(at + hi - lo, PARAM_ALIGN)
    return out


@dataclass
class Fragment:
    main: torch.Tensor  # fp32 view of the main buffer; .grad is a view of the grad buffer
    counted: bool  # counted in norms (not a replica of tp rank 0's copy)
    start: int  # where `main` begins in the flat buffers


# Per model parameter, what a checkpoint in model space holds (Megatron's names).
MODEL_SPACE = ("fp32_param", "exp_avg", "exp_avg_sq")


# Elements a reduction over a fragment takes at once: its temporaries (the squares, the zero mask)
# stay within 64 MiB, where a whole fragment's reach GiBs (the embedding of a 128K vocabulary). A
# fragment of at most this size is reduced as one piece, as before.
REDUCE_CHUNK = 1 << 24


def _pieces(tensors):
    """Every tensor's elements in pieces of at most REDUCE_CHUNK (views), in order."""
    for t in tensors:
        yield from t.reshape(-1).split(REDUCE_CHUNK)


class DistributedAdam:
    def __init__(self, named_params, buffer: GradBuffer, pgs, args, scaler: Optional[LossScaler] = None):
        self.buffer, self.pgs, self.scaler = buffer, pgs, scaler
        self.clip_grad = args.clip_grad
        self.check_nan = args.check_for_nan_in_loss_and_grad
        self.overlap_param_gather = args.overlap_param_gather  # the forward pre-hooks wait (GradBuffer)
        # --log-params-norm: taken in the step, before the parameter gathers it would queue behind
        self.log_params_norm, self.last_params_norm = args.log_params_norm, None
        names = {p: n for n, p in named_params}
        self.fp32_model = buffer.param_data.dtype == torch.float32
        self.device = buffer.param_data.device
        # The fp32 main parameters: the model's own buffer when fp32, else this rank's owned ranges
        # back to back (ZeRO-1: 4 bytes per parameter / dp, not a full-size copy on every rank).
        # _owned: (flat start, flat end, where the range begins in main_data) per owned range.
        if self.fp32_model:
            self._owned = [(lo, hi, lo) for lo, hi in buffer.owned_ranges()]
            self.main_data = buffer.param_data
        else:
            self._owned = _packed(buffer.owned_ranges())
            self.main_data = self._main_copy()
        tp_rank = pgs.index("tp")
        self.fragments: List[Fragment] = []
        self.fragments_of: Dict[torch.nn.Parameter, List[Fragment]] = {}  # this rank's pieces of each
        groups = {key: [] for key in GROUP_ORDER}
        for p, start, end in buffer.param_fragments():
            main = self._main(start, end)
            main.grad = buffer.grad_data[start:end]
            # Counted once: tp replicas only on tp rank 0, the tied embedding only on the first stage.
            counted = (getattr(p, "tensor_model_parallel", False) or tp_rank == 0) and not getattr(p, "shared", False)
            self.fragments.append(Fragment(main, counted, start))
            self.fragments_of.setdefault(p, []).append(self.fragments[-1])
            groups[group_key(names[p], p, args)].append(main)
        # Every group the model has, even one empty in this rank's shard (a rank may own nothing):
        # the groups, their order and the LR schedule are the same on every rank.
        present = {group_key(n, p, args) for p, n in names.items() if p.requires_grad}
        self.group_keys = [key for key in GROUP_ORDER if key in present]  # of self.param_groups, in turn
        param_groups = [param_group(groups[key], *key, args) for key in self.group_keys]
        self.fused = fused_adamw(self.device)
        self.optimizer = torch.optim.AdamW(
            param_groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps, weight_decay=args.weight_decay, fused=self.fused,
        )
        # Adam's step count, kept here rather than read from a parameter's state: a rank whose
        # shard is all padding has none, and every rank must agree on it
        self.steps = 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups  # what the LR scheduler drives

    def _main_copy(self) -> torch.Tensor:
        end = max((at + hi - lo for lo, hi, at in self._owned), default=0)
        main = torch.zeros(end, dtype=torch.float32, device=self.device)
        for lo, hi, at in self._owned:
            main[at : at + hi - lo] = self.buffer.param_data[lo:hi]  # -> fp32
        return main

    def _main(self, lo: int, hi: int) -> torch.Tensor:
        """The main parameters of flat range [lo, hi), which lies inside one owned range."""
        for start, end, at in self._owned:
            if start <= lo and hi <= end:
                return self.main_data[at + lo - start : at + hi - start]
        raise ValueError(f"flat range [{lo}, {hi}) is not inside one range this rank owns")

    # ---- global reductions -------------------------------------------------------------------
    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.buffer.shards > 1:
            dist.all_reduce(value, group=self.buffer.dp_group)
        if self.pgs.size("mp") > 1:
            dist.all_reduce(value, group=self.pgs.mp)
        return value

    def _norm(self, tensors) -> float:
        # Sums of squares per fragment, in this order: torch's multi-tensor norm would save kernels,
        # but it rounds differently, and the golden curves' zero-gradient counts (exact zeros,
        # chaotic under any rounding change) moved past their tolerance in a pipeline case.
        device = self.device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for piece in _pieces(tensors):
            sq += piece.float().square().sum()
        return math.sqrt(self._global_sum(sq).item())

    def grad_norm(self) -> float:
        return self._norm(f.main.grad for f in self.fragments if f.counted)

    def params_norm(self) -> float:
        return self._norm(f.main for f in self.fragments if f.counted)

    def count_zeros(self) -> int:
        zeros = torch.zeros((), dtype=torch.float32, device=self.device)
        for piece in _pieces(f.main.grad for f in self.fragments if f.counted):
            zeros += (piece == 0).sum()
        return int(self._global_sum(zeros).item())

    # ---- fp16 loss scaling ----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def _unscale_found_inf(self) -> bool:
        """Divide the main gradients by the loss scale; True if any rank holds a non-finite one."""
        device = self.device
        found = torch.zeros(1, dtype=torch.float32, device=device)  # set to 1 where one is not finite
        grads = [f.main.grad for f in self.fragments]
        if grads:  # torch's multi-tensor unscale-and-check (GradScaler's): one pass over them all
            inv = torch.full((1,), 1.0 / self.scaler.scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        return self._global_sum(found).item() > 0

    # ---- step ------------------------------------------------------------------------------------
    def step(self, count_zeros: bool = False):
        """Clip, update the owned main params, publish them to the model. Returns
        (update_successful, grad_norm, num_zeros) like megatron-core's optimizers; an fp16 step
        whose gradients overflowed changes nothing but the loss scale: (False, None, None)."""
        if self.scaler is not None:
            found_inf = self._unscale_found_inf()
            self.scaler.update(found_inf)
            if found_inf:
                self._note_params_norm()
                return False, None, None
        grad_norm = self.grad_norm()
        if self.check_nan and not math.isfinite(grad_norm):
            raise FloatingPointError(f"grad norm is {grad_norm}: NaN or Inf in the gradients")
        if self.clip_grad > 0:
            coeff = self.clip_grad / (grad_norm + 1.0e-6)
            if coeff < 1.0 and self.fragments:  # one multi-tensor kernel (the same products as one per fragment)
                torch._foreach_mul_([f.main.grad for f in self.fragments], coeff)
        num_zeros = self.count_zeros() if count_zeros else None
        self.optimizer.step()
        self.steps += 1
        if not self.fp32_model:
            for lo, hi in self.buffer.owned_ranges():
                self.buffer.param_data[lo:hi].copy_(self._main(lo, hi))
        self._note_params_norm()
        self.buffer.all_gather_params(async_op=self.overlap_param_gather)
        return True, grad_norm, num_zeros

    def _note_params_norm(self) -> None:
        """The step's params norm, from the owned main params, while nothing is queued on the
        data-parallel communicator: after the gathers its all-reduce and .item() would wait for them."""
        self.last_params_norm = self.params_norm() if self.log_params_norm else None

    def reload_model_params(self) -> None:
        """After loading model weights: the fp32 main copy starts from them."""
        if not self.fp32_model:
            for lo, hi in self.buffer.owned_ranges():
                self._main(lo, hi).copy_(self.buffer.param_data[lo:hi])

    def zero_grad(self) -> None:
        self.buffer.zero_grad()

    # ---- checkpoint (in model space, see megatron_optim.py) ------------------------------------
    def model_space_state(self, keep: bool = True) -> Optional[Dict[str, torch.Tensor]]:
        """Main params and Adam moments of every parameter of this model part, whole, in host
        memory, laid out like the flat buffers: the form a checkpoint cuts by model parameter, so
        that it loads under any tp/pp/dp. Collective over the data-parallel ranks; one that writes
        nothing passes keep=False, takes part in the gathers and keeps nothing (None): 12 bytes a
        parameter of host memory on the writer only."""
        size = self.buffer.param_data.numel()
        flats = {name: torch.zeros(size, dtype=torch.float32) for name in MODEL_SPACE} if keep else None
        for bucket, name, piece in self._gathered_buckets():
            if keep:
                flats[name][bucket.start : bucket.end] = piece
        return flats

    def param_space_state(self, holds) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
        """The same per parameter, for the parameters holds(p) picks (`writes` at a save): states[p][name]
        in p's shape in host memory, each a tensor of its own (a checkpoint writer would copy a view
        first, as it serializes a view's whole storage), cut from one bucket at a time: the host
        holds each picked state once, not a flat copy beside it."""
        states = {p: {} for p in self.buffer.offsets if holds(p)}
        for bucket, name, piece in self._gathered_buckets():
            for p in (p for p in bucket.params if p in states):
                lo = self.buffer.offsets[p] - bucket.start
                states[p][name] = piece[lo : lo + p.numel()].to("cpu", copy=True).view_as(p)  # flat -> p's shape
        return states

    def writes(self, p: torch.nn.Parameter) -> bool:
        """Whether this rank holds and writes p's state in a torch_dist save, as p's one writer among
        the data-parallel replicas (each bucket is whole on every one of them first, sharded or not),
        so that no rank keeps the whole model part's state in its host memory (12 bytes a parameter,
        on every data-parallel rank of a node at once). The flat buffer is cut into one equal share
        per replica and p goes to the share holding its middle element: the replicas write about
        equal amounts (by first element, a bucket's leading large matrix went to the first share)."""
        middle = self.buffer.offsets[p] + p.numel() // 2
        return middle * self.buffer.dp_size // self.buffer.param_data.numel() == self.buffer.replica_rank()

    def _gathered_buckets(self):
        """(bucket, name, fp32 tensor over the bucket, on the state's device) for every bucket and
        MODEL_SPACE name, whole on every data-parallel rank. One bucket at a time: the device holds
        one bucket's copy, not three fp32 copies of the model part."""
        device = self.device
        for bucket in self.buffer.buckets:
            inside = [f for f in self.fragments if bucket.start <= f.start < bucket.end]
            for name in MODEL_SPACE:
                piece = torch.zeros(bucket.end - bucket.start, dtype=torch.float32, device=device)
                for f in inside:
                    source = f.main if name == "fp32_param" else self.optimizer.state[f.main].get(name)
                    if source is not None:  # no moments before the first step
                        piece[f.start - bucket.start : f.start - bucket.start + f.main.numel()] = source
                if self.buffer.shards > 1:
                    self.buffer.gather_bucket(piece, bucket)
                yield bucket, name, piece

    def param_state(self, p, name: str) -> Optional[torch.Tensor]:
        """Unsharded only: model parameter p's `name` (one of MODEL_SPACE) in p's shape, read from
        the live state without a copy of the whole model; None for a moment before the first step."""
        pieces = [f.main if name == "fp32_param" else self.optimizer.state[f.main].get(name)
                  for f in self.fragments_of[p]]
        if any(piece is None for piece in pieces):
            return None
        whole = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # one fragment per bucket it spans
        return whole.view(p.shape)  # flat [numel] -> p's shape

    def adam_steps(self) -> int:
        """Adam's step count (the same for every parameter; bias correction depends on it)."""
        return self.steps

    def reads_first(self, p: torch.nn.Parameter) -> bool:
        """Whether this rank is p's one reader among all data-parallel ranks when a load cuts the
        state by parameter: the first owner of p's first element."""
        starts = [f.start for f in self.fragments_of.get(p, ())]
        return self.buffer.offsets[p] in starts and self.buffer.first_of_replicas()

    def load_model_space_state(self, flats: Dict[str, torch.Tensor], steps: int) -> None:
        """Inverse of model_space_state: take this rank's owned pieces; the model's own copy of the
        weights must already be loaded (they agree with the main params to the model's precision)."""
        self._load_pieces(lambda f, name: flats[name][f.start : f.start + f.main.numel()], steps)

    def load_param_states(self, states: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]], steps: int) -> None:
        """The same from each owned parameter's state in the parameter's own shape (what a torch_dist
        load reads): `states[p][name]` for every p this rank owns a piece of."""
        offsets = self.buffer.offsets
        where = {id(f): (p, f.start - offsets[p]) for p, pieces in self.fragments_of.items() for f in pieces}

        def piece(f: Fragment, name: str) -> torch.Tensor:
            p, lo = where[id(f)]
            return states[p][name].reshape(-1)[lo : lo + f.main.numel()]  # p's shape -> flat [numel]
        self._load_pieces(piece, steps)

    def _load_pieces(self, piece, steps: int) -> None:
        """piece(fragment, name): that fragment's values of `name` (one of MODEL_SPACE), any device."""
        self.steps = steps
        for f in self.fragments:
            f.main.copy_(piece(f, "fp32_param"))
            self.optimizer.state.pop(f.main, None)
            if steps:
                self.optimizer.state[f.main] = {"step": self._step_tensor(steps, f.main.device),
                                                "exp_avg": piece(f, "exp_avg").to(f.main.device, copy=True),
                                                "exp_avg_sq": piece(f, "exp_avg_sq").to(f.main.device, copy=True)}

    def _step_tensor(self, steps: int, device: torch.device) -> torch.Tensor:
        """Adam's step where torch's AdamW keeps it: a float32 scalar on the host, or on the
        parameter's device for the fused kernel (torch's note [special device hosting for step])."""
        return torch.tensor(float(steps), dtype=torch.float32, device=device if self.fused else "cpu")
