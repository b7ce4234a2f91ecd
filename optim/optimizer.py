"""MuonAdam: the one optimizer object. It owns the parameter state and all gradient communication."""
import torch
import torch.distributed as dist
from torch.optim.adam import adam

from optim.iterations import check_method
from optim.muon import apply_updates, nesterov_momentum, neuron_scales, neuron_shape, newton_schulz, shape_scale


class _MuonBucket:
    """The parameters of one Muon group that share a shape, stacked so one call handles them all."""

    def __init__(self, group: str, params: list[torch.Tensor], world_size: int, normuon: bool):
        self.group = group
        self.params = params
        self.momentum = torch.zeros((len(params), *params[0].shape), dtype=params[0].dtype,
                                    device=params[0].device)
        # NorMuon's running mean square per neuron (optim.muon.neuron_scales), when it is on
        self.second_moment = torch.zeros(neuron_shape((len(params), *params[0].shape)), device=params[0].device) \
            if normuon else None
        self.scale = shape_scale(params[0].shape)
        self.share = -(-len(params) // world_size)  # matrices each rank orthogonalises (rank-padded)


class MuonAdam:
    """Muon for the "muon" groups (hidden matrices), Adam for the "adam" groups, in one `step`.

    `param_groups` is the model's list of {"kind": "muon" | "adam", "name": str, "params": [...]}; `lr` maps each
    group name to its base learning rate. Muon parameters with more than two dims are stacks of matrices.

    With world_size > 1: an async all_reduce(SUM) per gradient starts up front, Muon groups first, each group waiting
    only for its own; Muon groups are stacked by shape, every rank updates the whole stack's momentum but
    orthogonalises only its zero-padded share, and an async all_gather collects the bf16 updates while Adam runs.
    Every rank then applies the same updates, so parameters and the replicated state agree, and `state_dict` does
    not depend on the world size. Nothing is compiled, which keeps a cold start short.
    """

    def __init__(self, param_groups: list[dict], *, lr: dict[str, float],
                 adam_betas: tuple[float, float] = (0.8, 0.95), adam_eps: float = 1e-10,
                 rank: int = 0, world_size: int = 1, muon_method: str = "jordan", normuon_beta2: float = 0.0):
        """normuon_beta2 > 0 turns NorMuon on with this averaging factor; 0 is plain Muon."""
        check_method(muon_method)
        assert 0.0 <= normuon_beta2 < 1.0, f"normuon_beta2 {normuon_beta2} outside [0, 1)"
        seen: set[int] = set()
        for group in param_groups:
            assert group["kind"] in ("muon", "adam"), f"group {group['name']!r}: unknown kind {group['kind']!r}"
            for p in group["params"]:
                assert id(p) not in seen, f"a parameter of group {group['name']!r} appears in two groups"
                seen.add(id(p))
            if group["kind"] == "muon":
                assert all(p.ndim >= 2 for p in group["params"]), f"Muon group {group['name']!r} has a <2-D param"
        names = [g["name"] for g in param_groups]
        assert len(set(names)) == len(names), f"group names repeat: {names}"
        missing = [n for n in names if n not in lr]
        if missing:
            raise ValueError(f"no learning rate for parameter group(s) {missing}: give every group of the model "
                             f"({names}) a base learning rate")
        if world_size > 1:
            assert dist.is_initialized(), "world_size > 1 needs torch.distributed initialised by the caller"
        assert 0 <= rank < world_size, f"rank {rank} outside world of {world_size}"

        self.param_groups = param_groups
        self.base_lr = {n: float(lr[n]) for n in names}
        self.beta1, self.beta2 = adam_betas
        self.eps = adam_eps
        self.rank, self.world_size = rank, world_size
        self.step_count = 0
        self.muon_method = muon_method
        self.normuon_beta2 = normuon_beta2

        self._buckets: list[_MuonBucket] = []
        # per Adam group: moments and fused Adam's per-parameter step counts (0-D fp32, incremented by torch)
        self._adam: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}
        for group in param_groups:
            if group["kind"] == "muon":
                by_shape: dict[torch.Size, list[torch.Tensor]] = {}
                for p in group["params"]:
                    by_shape.setdefault(p.shape, []).append(p)
                self._buckets += [_MuonBucket(group["name"], ps, world_size, normuon_beta2 > 0)
                                  for ps in by_shape.values()]
            else:
                ps = group["params"]
                self._adam[group["name"]] = ([torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
                                             [torch.zeros((), device=p.device) for p in ps])

    @torch.no_grad()
    def step(self, lr_multiplier: float, muon_momentum: float) -> None:
        """One update of every parameter from its `.grad`, which then holds the average over ranks."""
        assert 0.0 <= muon_momentum < 1.0, f"muon_momentum {muon_momentum} outside [0, 1)"
        self.step_count += 1
        lr = {name: base * lr_multiplier for name, base in self.base_lr.items()}

        distributed = self.world_size > 1
        pending = {}
        if distributed:
            muon_first = [p for b in self._buckets for p in b.params]
            muon_first += [p for g in self._adam_groups() for p in g["params"]]
            for p in muon_first:
                assert p.grad is not None, "every parameter needs a gradient on every rank"
                pending[id(p)] = dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True)

        gathers = []
        for bucket in self._buckets:
            grads = torch.stack(self._averaged_grads(bucket.params, pending))
            direction = nesterov_momentum(grads, bucket.momentum, muon_momentum)
            if not distributed:
                self._apply(bucket, self._orthogonalize(direction), lr)
                continue
            mine = direction[self.rank * bucket.share:(self.rank + 1) * bucket.share]
            if len(mine) < bucket.share:
                mine = torch.cat([mine, mine.new_zeros((bucket.share - len(mine), *mine.shape[1:]))])
            update = self._orthogonalize(mine).contiguous()  # NCCL needs contiguous; tall outputs are views
            gathered = update.new_empty((bucket.share * self.world_size, *update.shape[1:]))
            work = dist.all_gather(list(gathered.chunk(self.world_size)), update, async_op=True)
            gathers.append((bucket, update, gathered, work))  # `update` stays alive until the wait

        for group in self._adam_groups():
            params = group["params"]
            exp_avgs, exp_avg_sqs, steps = self._adam[group["name"]]
            adam(params, self._averaged_grads(params, pending), exp_avgs, exp_avg_sqs, [], steps, fused=True,
                 amsgrad=False, beta1=self.beta1, beta2=self.beta2, lr=lr[group["name"]], weight_decay=0.0,
                 eps=self.eps, maximize=False)

        for bucket, _, gathered, work in gathers:
            work.wait()
            self._apply(bucket, gathered[:len(bucket.params)], lr)

    def _orthogonalize(self, stack: torch.Tensor) -> torch.Tensor:
        """Newton-Schulz on a stack of matrices (a method, so that tests can watch it)."""
        return newton_schulz(stack, self.muon_method)

    def _apply(self, bucket: _MuonBucket, updates: torch.Tensor, lr: dict[str, float]) -> None:
        """The bucket's orthogonalised updates, one per parameter, evened out per neuron where NorMuon is on."""
        scales = None if bucket.second_moment is None else \
            neuron_scales(updates, bucket.second_moment, self.normuon_beta2)
        apply_updates(bucket.params, updates, lr[bucket.group] * bucket.scale, scales)

    def zero_grad(self) -> None:
        """Drop every gradient (torch.optim's default): the next backward writes new ones, no zero-fill first."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict:
        """{"step": int, "groups": {name: {"momentum" (and "second_moment") or "exp_avg" and "exp_avg_sq": live
        per-parameter buffers}}}, the same on every rank and world size."""
        groups = {}
        for group in self.param_groups:
            if group["kind"] == "muon":
                groups[group["name"]] = self._muon_state(group["params"])
            else:
                exp_avgs, exp_avg_sqs, _ = self._adam[group["name"]]
                groups[group["name"]] = {"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs}
        return {"step": self.step_count, "groups": groups}

    def load_state_dict(self, state: dict) -> None:
        """Copies a `state_dict` into this optimizer's buffers; the next `step` continues bit for bit."""
        saved = state["groups"]
        if set(saved) != set(self.base_lr):
            raise ValueError(f"optimizer state has groups {sorted(saved)} but the model has {sorted(self.base_lr)}: "
                             f"resume with the model configuration the checkpoint was written with")
        for group in self.param_groups:
            name, params = group["name"], group["params"]
            if group["kind"] == "muon":
                targets = self._muon_state(params)
            else:
                exp_avgs, exp_avg_sqs, _ = self._adam[name]
                targets = {"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs}
            if set(saved[name]) != set(targets):
                raise ValueError(f"optimizer state of group {name!r} holds {sorted(saved[name])}, expected "
                                 f"{sorted(targets)}: the checkpoint was written by another optimizer")
            for key, dsts in targets.items():
                srcs = saved[name][key]
                if [tuple(s.shape) for s in srcs] != [tuple(d.shape) for d in dsts]:
                    raise ValueError(f"optimizer state {name}.{key} has shapes that differ from the model's "
                                     f"parameters: resume with the model configuration of the checkpoint")
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src)
        self.step_count = int(state["step"])
        for _, _, steps in self._adam.values():
            for t in steps:
                t.fill_(self.step_count)

    def _averaged_grads(self, params: list[torch.Tensor], pending: dict) -> list[torch.Tensor]:
        """The parameters' gradients, averaged over ranks once their all_reduce (if any) has finished."""
        grads = []
        for p in params:
            assert p.grad is not None, "every parameter needs a gradient before step()"
            if id(p) in pending:
                pending.pop(id(p)).wait()
                p.grad.div_(self.world_size)
            grads.append(p.grad)
        return grads

    def _adam_groups(self) -> list[dict]:
        return [g for g in self.param_groups if g["kind"] == "adam"]

    def _muon_state(self, params: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        """{"momentum": [...], and "second_moment": [...] with NorMuon}: views into the buckets, in `params` order."""
        where = {id(q): (bucket, i) for bucket in self._buckets for i, q in enumerate(bucket.params)}
        slots = [where[id(p)] for p in params]
        state = {"momentum": [bucket.momentum[i] for bucket, i in slots]}
        if self.normuon_beta2 > 0:
            state["second_moment"] = [bucket.second_moment[i] for bucket, i in slots]
        return state
