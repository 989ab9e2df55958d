"""Turn a step's logits into tokens, in two halves (as mini-sglang splits it).

`prepare(seqs)` runs once per step on the host, before the forward pass: every row's parameters
(temperature, top-k, top-p, min-p, penalties, random draws, logprob requests) become a few
tensors on the logits' device. `sample(logits, batch)` runs on that device: only the chosen ids
and the logprobs rows asked for come back to the host.

The kept candidate set of a row is an intersection of thresholds on its scaled logits, applied
in this order: top-k (the k-th largest value; ties with it stay), top-p (over the top-k set,
renormalized: the smallest prefix by descending probability whose mass reaches top_p, the
token that crosses it and its ties included), min-p (probability at least min_p times the
largest). Nothing sorts the vocabulary: top-k rows pick among their k largest values and the
k-th's ties; rows without top-k sample the whole row by inverse CDF, and top-p there is exact
rejection sampling (draw from the row above a pivot, accept if the token is inside the top-p
set, else raise the pivot to it), which needs about 1 / top_p rounds.

On CPU every sampled row takes one C call for the whole step (kernels/cpu/sampling.c,
`sample_fused`): per row, penalties on its seen ids, the candidates or the whole-row weights,
the filters and the draw, reading the logits in the model's dtype, with no torch op in between
(a step of sampled rows cost as much Python as its arithmetic before). The rare rows it hands
back (top-k ties past the candidates' room, a whole row rejected CPU_SAMPLE_ROUNDS times) and
greedy rows take the general path, which on other devices runs as torch ops and on CPU uses C
for its vocabulary-wide passes (argmax, top-k candidates, whole-row draws).

On other devices nothing in `sample` waits for the host until the step's tokens are copied back:
`prepare` makes every index and parameter tensor (row sets, penalties, the uniform draws) with
non-blocking copies while the forward pass runs, and the rows the device pass cannot settle (top-k
ties past the candidates' room, whole rows every rejection round rejected) come back as flags in
that same copy and are settled after it, exactly, on the slow path. On a GPU each blocking copy or
`bool(tensor)` mid-sample is a stream sync that leaves it idle while the host launches the next op.
On CUDA the penalties' gather and the draws are Triton kernels (kernels/sampling.py): the top-k
rows' candidates come from the densely penalized fp32 rows (cheap there), and a sampled step
launches about 9 kernels where the same in torch ops takes about 60 (bench/sampler.py --launches).

Before any of that, the rows with logits processors (logit_bias, allowed_token_ids, bad_words,
min_tokens: services/engine/logits_processors.py) get them, then the rows with penalties theirs.

Randomness: every draw is one uniform per row. Seeded rows take it from a counter-based hash of
(seed, output position, round), so a row's tokens depend on nothing else in the batch and a
resumed stream needs no replay of earlier draws; other rows share the engine's generator (in
the fused kernel: a key drawn from it each step, hashed the same way).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels import cpu as cpu_kernels
from services.engine import logits_processors
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence
from services.engine.structured import apply_masks as structured_masks

NEG_INF = float("-inf")
DEVICE_REJECTION_ROUNDS = 3  # top-p rejection rounds in torch (every row runs each); then the exact sort
SORT_ROUND = 64  # the uniform draw of that sort (a round index no rejection round reaches)
CPU_SAMPLE_ROUNDS = 8  # top-p rejection rounds in the C kernel; a row rejected 8 times continues in torch
TOP_K_TIE_ROOM = 256  # candidates past the k-th value for its ties; more ties: the full path
MERGED_TIE_ROOM = 64  # the same after merging penalized seen ids: torch's topk slows with its width

_MASK64 = (1 << 64) - 1
_NO_SEEN_IDS, _NO_SEEN_COUNTS = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over uint64s (wrapping arithmetic)."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_uniforms(seeds: list[int], positions: list[int], round_: int | range = 0) -> np.ndarray:
    """One uniform in [0, 1) per (seed, position, round): a pure function of its key. [n] for one
    round, [n, len(rounds)] for a range of them."""
    rounds = np.array([(r * 0xA0761D6478BD642F) & _MASK64 for r in np.atleast_1d(round_).tolist()],
                      dtype=np.uint64)
    with np.errstate(over="ignore"):
        s = np.array([seed & _MASK64 for seed in seeds], dtype=np.uint64)
        key = _splitmix64(s) ^ np.array(positions, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93)
        key = _splitmix64(key[:, None] ^ rounds[None, :])
    u = (key >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return u if isinstance(round_, range) else u[:, 0]


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row, when that row asked for logprobs: (chosen logprob, {token id: logprob} top-n).
    logprobs: list[tuple[float, dict[int, float]] | None]


class Penalties:
    """The rows with a penalty and, for each, every distinct id it has seen (prompt and output,
    in first-seen order: services.engine.seen_tokens). A penalty changes only those ids'
    logits, so the sampler gathers them, penalizes them in fp32, and never needs an fp32 copy
    of a whole row to do it.

    Held as one flat run of ids and output counts, each row's from its offset (what the fused
    CPU kernel reads, as it is); the general path's view, one rectangle of tensors, is built on
    first use. There, padding repeats the row's first id with its count, so writing the
    penalized values back writes equal values for equal ids; `distinct` is False there."""

    def __init__(self, rows: list[int], seen: list[tuple[np.ndarray, np.ndarray]], params: list,
                 device: torch.device):
        self.row_list = rows
        self.index = {r: j for j, r in enumerate(rows)}  # batch row -> its row here
        self.lengths = np.fromiter((len(a) for a, _ in seen), dtype=np.int64, count=len(seen))
        self.offsets = np.zeros(len(seen), dtype=np.int64)
        np.cumsum(self.lengths[:-1], out=self.offsets[1:])
        self.flat_ids = np.concatenate([a for a, _ in seen])  # int64
        self.flat_counts = np.concatenate([c for _, c in seen])  # fp32: occurrences among the outputs
        self.repetition_list = [p.repetition_penalty for p in params]
        self.frequency_list = [p.frequency_penalty for p in params]
        self.presence_list = [p.presence_penalty for p in params]
        self.device = device

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32).view(-1, 1).to(self.device, non_blocking=True)

    def upload(self) -> None:
        """Make the general path's tensors now, in `prepare` (made in `sample`, each copy would
        wait for the forward pass on a GPU)."""
        _ = self.ids, self.rows, self.repetition, self.frequency, self.presence

    @functools.cached_property
    def _rectangle(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [p, L] int64, distinct [p, L] bool, output counts [p, L] fp32)."""
        width = int(self.lengths.max())
        distinct = np.arange(width)[None, :] < self.lengths[:, None]
        # Padding: the row's first id and count (its offset), real entries from the flat run.
        where = np.where(distinct, self.offsets[:, None] + np.arange(width)[None, :], self.offsets[:, None])
        return tuple(torch.from_numpy(a).to(self.device, non_blocking=True)
                     for a in (self.flat_ids[where], distinct, self.flat_counts[where]))

    @functools.cached_property
    def rows(self) -> torch.Tensor:  # [p] row indices into the batch
        return torch.tensor(self.row_list).to(self.device, non_blocking=True)

    @property
    def ids(self) -> torch.Tensor:  # [p, L] seen ids
        return self._rectangle[0]

    @property
    def distinct(self) -> torch.Tensor:  # [p, L] bool: not padding
        return self._rectangle[1]

    @property
    def output_counts(self) -> torch.Tensor:  # [p, L] fp32: how often the id occurs among the row's outputs
        return self._rectangle[2]

    # As in transformers/CTRL: over prompt and output tokens. [p, 1]; None when no row has one.
    @functools.cached_property
    def repetition(self) -> torch.Tensor | None:
        return self._column(self.repetition_list) if any(r != 1.0 for r in self.repetition_list) else None

    # As in the OpenAI API: over generated tokens only. [p, 1]; None (both) when no row has either.
    @functools.cached_property
    def frequency(self) -> torch.Tensor | None:
        return self._column(self.frequency_list) if self._any_count else None

    @functools.cached_property
    def presence(self) -> torch.Tensor | None:
        return self._column(self.presence_list) if self._any_count else None

    @property
    def _any_count(self) -> bool:
        return any(f or p for f, p in zip(self.frequency_list, self.presence_list))


@dataclass
class RowSet:
    """Some rows of a step's batch (its greedy, top-k, whole-row or logprob rows) with their index
    tensors on the logits' device, so that sampling gathers them without building an index from
    a Python list (on a GPU a blocking copy: a stream sync)."""

    rows: list[int]
    index: torch.Tensor  # [len(rows)] int64
    whole: bool  # every row of the batch, in order: nothing to gather
    penalized: torch.Tensor | None  # positions in `rows` of the rows with penalties; None: none has
    penalty_rows: torch.Tensor | None  # their rows in the batch's Penalties

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def of(self, x: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """These rows of x (indexed by the batch's rows); x itself when they are all of it,
        unless a copy is asked for."""
        if self.whole:
            return x.clone() if copy else x
        return x.index_select(0, self.index)

    @staticmethod
    def build(row_lists: list[list[int]], num_rows: int, penalties: Penalties | None,
              device: torch.device) -> list[RowSet]:
        """One RowSet per list, every index in one non-blocking copy."""
        parts, layout = [], []
        for rows in row_lists:
            pairs = [(i, penalties.index[r]) for i, r in enumerate(rows) if r in penalties.index] if penalties else []
            parts += [rows, [i for i, _ in pairs], [j for _, j in pairs]]
            layout.append((rows, bool(pairs)))
        sizes = [len(p) for p in parts]
        flat = torch.from_numpy(np.fromiter((i for p in parts for i in p), dtype=np.int64, count=sum(sizes)))
        views = iter(flat.to(device, non_blocking=True).split(sizes))
        out = []
        for rows, any_penalized in layout:
            index, penalized, penalty_rows = next(views), next(views), next(views)
            out.append(RowSet(rows, index, rows == list(range(num_rows)),
                              penalized if any_penalized else None, penalty_rows if any_penalized else None))
        return out


@dataclass
class RowSets:
    greedy: RowSet
    top_k: RowSet
    full: RowSet
    logprobs: RowSet


@dataclass
class SamplingBatch:
    """One step's sampling parameters, one row per sequence that samples."""

    num_rows: int
    device: torch.device
    all_greedy: bool = True
    greedy_rows: list[int] = field(default_factory=list)
    temperature: torch.Tensor | None = None  # [n, 1]; 1 on greedy rows
    top_k_rows: list[int] = field(default_factory=list)  # sampled rows with top-k on
    top_k: torch.Tensor | None = None  # [len(top_k_rows), 1] int64
    max_top_k: int = 0
    full_rows: list[int] = field(default_factory=list)  # sampled rows without top-k
    top_p: torch.Tensor | None = None  # [n, 1]
    any_top_p: bool = False
    log_min_p: torch.Tensor | None = None  # [n, 1]; -inf where min-p is off
    any_min_p: bool = False
    # Uniform draws: seeded rows by (seed, position); others from the sampler's generator.
    seeded_rows: list[int] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    penalties: Penalties | None = None
    logprob_rows: list[int] = field(default_factory=list)
    logprob_counts: list[int] = field(default_factory=list)
    grammar_masks: object = None  # structured outputs: structured.StepMasks, or None
    processors: logits_processors.LogitsProcessing | None = None  # logit_bias, bad_words, ...
    # CPU: the sampled rows' parameters for the fused kernel (kernels.cpu.SAMPLE_ROW), and the
    # penalized rows' seen ids and output counts it reads (flat, from each row's seen_offset).
    fused_table: np.ndarray | None = None
    seen_ids: np.ndarray | None = None
    seen_counts: np.ndarray | None = None
    unseeded: np.ndarray | None = None  # [len(fused_table)] bool: rows whose key is drawn afresh each step
    # Off the CPU: every row's uniform draws for rounds 0..DEVICE_REJECTION_ROUNDS-1, [n, rounds] fp64.
    uniforms: torch.Tensor | None = None
    _row_sets: RowSets | None = None

    def row_sets(self) -> RowSets:
        """The greedy, top-k, whole-row and logprob rows as RowSets (made once)."""
        if self._row_sets is None:
            self._row_sets = RowSets(*RowSet.build([self.greedy_rows, self.top_k_rows, self.full_rows,
                                                    self.logprob_rows], self.num_rows, self.penalties, self.device))
        return self._row_sets

    def row_set(self, rows: list[int]) -> RowSet:
        return RowSet.build([rows], self.num_rows, self.penalties, self.device)[0]


@functools.cache
def _triton_sampling():
    """kernels.sampling, imported on first use (importing triton fixes whether it interprets)."""
    from kernels import sampling
    return sampling


class Sampler:
    use_c_kernels = True  # False: the general path in torch ops even on CPU, as on other devices (tests)
    # The device path's draws as Triton kernels (kernels/sampling.py). None: on CUDA; True: on any
    # device (tests run them on CPU through TRITON_INTERPRET=1); False: torch ops everywhere.
    use_triton_kernels: bool | None = None

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", fused: bool = True,
                 backend: str = "auto"):
        """fused: on CPU, sampled rows go through the fused C kernel; False keeps them on the
        general path (bench/sampler.py compares the two). backend: EngineArgs.sampler_backend
        (auto: the class's choices; torch: torch ops only; triton: the Triton kernels, no C)."""
        if backend != "auto":
            self.use_c_kernels, self.use_triton_kernels = False, backend == "triton"
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.fused = fused
        self.generator = torch.Generator()  # unseeded rows; seeded once so runs are repeatable
        self.generator.manual_seed(0)
        self._f32_buffer: torch.Tensor | None = None
        self.structured = None  # structured.StructuredOutputs: token masks of structured rows

    # The batch-wide variants the Triton kernels compile for (top-p, min-p, each penalty kind), one
    # batch each, every batch with a top-k row, a whole row and a logprob row.
    WARM_UP_BATCHES = (dict(top_p=0.9, min_p=0.05, repetition_penalty=1.1),
                       dict(top_p=0.9, frequency_penalty=0.5, presence_penalty=0.5),
                       dict(min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5), dict())

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the Triton kernels' variants for logits of this dtype at load where they run
        (CUDA), rather than in the first steps that meet them (a compile takes seconds; later
        processes read it from Triton's cache)."""
        if self._triton_kernels(torch.empty(0, device=self.device)) is None:
            return
        rising = torch.linspace(-4, 4, self.vocab_size, device=self.device, dtype=dtype)  # no ties
        for i, params in enumerate(self.WARM_UP_BATCHES):
            seqs = [Sequence(f"warm-up-{i}-{j}", [0, 1], SamplingParams(temperature=0.8, top_k=top_k, logprobs=1,
                                                                        **params).resolved())
                    for j, top_k in enumerate((50, -1))]
            for seq in seqs:
                seq.token_ids.append(2)  # an output token: the output counts of frequency and presence
            self.sample(rising.expand(len(seqs), -1).clone(), self.prepare(seqs))

    # ---- prepare: host, once per step --------------------------------------------------------
    def prepare(self, seqs: list[Sequence]) -> SamplingBatch:
        dev = self.device
        params = [s.params for s in seqs]
        batch = SamplingBatch(len(seqs), dev)
        for i, p in enumerate(params):
            if p.logprobs is not None:
                batch.logprob_rows.append(i)
                batch.logprob_counts.append(p.logprobs)
        greedy = [p.greedy for p in params]
        sampled = [i for i, g in enumerate(greedy) if not g]
        batch.greedy_rows = [i for i, g in enumerate(greedy) if g]
        batch.all_greedy = not sampled
        if self.structured is not None:
            batch.grammar_masks = self.structured.prepare_masks(seqs, dev)
        batch.processors = logits_processors.prepare(seqs, dev)
        penalized = [i for i, p in enumerate(params) if p.needs_penalties]
        if penalized:
            batch.penalties = self._prepare_penalties(seqs, penalized)
        if batch.all_greedy:
            if not self._c_kernels_on(dev):
                self._prepare_device(batch)
            return batch

        def column(values, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).view(-1, 1).to(dev, non_blocking=True)

        batch.temperature = column([1.0 if g else p.temperature for g, p in zip(greedy, params)])
        for i in sampled:
            p = params[i]
            if p.top_k > 0 and p.top_k < self.vocab_size:
                batch.top_k_rows.append(i)
            else:
                batch.full_rows.append(i)
            if p.seed is not None:
                batch.seeded_rows.append(i)
                batch.seeds.append(p.seed)
                batch.positions.append(seqs[i].num_output_tokens)
        if batch.top_k_rows:
            ks = [params[i].top_k for i in batch.top_k_rows]
            batch.top_k = column(ks, torch.int64)
            batch.max_top_k = max(ks)
        batch.any_top_p = any(params[i].top_p < 1.0 for i in sampled)
        if batch.any_top_p:
            batch.top_p = column([p.top_p for p in params])
        batch.any_min_p = any(params[i].min_p > 0.0 for i in sampled)
        if batch.any_min_p:
            batch.log_min_p = column([float(np.log(p.min_p)) if p.min_p > 0 else NEG_INF for p in params])
        if dev.type == "cpu" and self.fused and self.use_c_kernels:
            self._prepare_fused_table(seqs, batch)
        if batch.fused_table is None and not self._c_kernels_on(dev):
            self._prepare_device(batch)
        return batch

    def _c_kernels_on(self, device: torch.device) -> bool:
        return device.type == "cpu" and self.use_c_kernels and cpu_kernels.load() is not None

    def _prepare_device(self, batch: SamplingBatch) -> None:
        """Everything the torch path reads, made now with non-blocking copies (they overlap the
        forward pass): the row sets, the penalties' tensors, each row's uniform draws."""
        batch.row_sets()
        if batch.penalties is not None:
            batch.penalties.upload()
        if batch.all_greedy:
            return
        rounds = DEVICE_REJECTION_ROUNDS
        u = torch.rand(batch.num_rows, rounds, generator=self.generator, dtype=torch.float64)
        if batch.seeded_rows:
            u[batch.seeded_rows] = torch.from_numpy(counter_uniforms(batch.seeds, batch.positions, range(rounds)))
        batch.uniforms = u.to(batch.device, non_blocking=True)

    @staticmethod
    def _prepare_fused_table(seqs: list[Sequence], batch: SamplingBatch) -> None:
        """The fused CPU kernel's view of the sampled rows: one SAMPLE_ROW each (the keys of
        unseeded rows are drawn at sample time, from the sampler's generator)."""
        top_k_rows = set(batch.top_k_rows)
        rows = sorted(batch.top_k_rows + batch.full_rows)
        ps = [seqs[i].params for i in rows]
        table = np.zeros(len(rows), dtype=cpu_kernels.SAMPLE_ROW)
        table["row"] = rows
        table["temperature"] = [p.temperature for p in ps]
        table["top_k"] = [p.top_k if r in top_k_rows else 0 for r, p in zip(rows, ps)]
        table["top_p"] = [p.top_p for p in ps]
        table["log_min_p"] = [np.log(p.min_p) if p.min_p > 0 else NEG_INF for p in ps]
        table["seed"] = [(p.seed or 0) & _MASK64 for p in ps]
        table["position"] = [seqs[i].num_output_tokens for i in rows]
        table["repetition"] = 1.0
        if (pen := batch.penalties) is not None:
            prows = np.fromiter((pen.index.get(r, -1) for r in rows), dtype=np.int64, count=len(rows))
            has = prows >= 0
            if has.any():
                at = prows[has]
                table["seen_offset"][has] = pen.offsets[at]
                table["seen_len"][has] = pen.lengths[at]
                table["repetition"][has] = np.asarray(pen.repetition_list, dtype=np.float32)[at]
                table["frequency"][has] = np.asarray(pen.frequency_list, dtype=np.float32)[at]
                table["presence"][has] = np.asarray(pen.presence_list, dtype=np.float32)[at]
            batch.seen_ids, batch.seen_counts = pen.flat_ids, pen.flat_counts
        batch.fused_table = table
        batch.unseeded = np.array([p.seed is None for p in ps])

    def _prepare_penalties(self, seqs: list[Sequence], rows: list[int]) -> Penalties:
        # (distinct ids, output counts), kept per sequence and brought up to date incrementally
        return Penalties(rows, [seqs[i].seen_arrays() for i in rows], [seqs[i].params for i in rows], self.device)

    # ---- sample: on the logits' device -------------------------------------------------------
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        return self.sample(logits, self.prepare(seqs))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        """Tokens for the step; `logits` ([rows, >= vocab], any float dtype) may be overwritten.
        Logits stay in the model's dtype where only comparisons read them (argmax, top-k
        candidates). Penalties touch only the ids a row has seen: their penalized values are
        kept aside in fp32 and the ids masked in `logits`, so the vocabulary-wide passes read the
        rest as it is and take the seen ids from the side; only rows sampled over the whole
        vocabulary get an fp32 copy. (With the Triton kernels every penalized row is read from an
        fp32 copy with its penalized values in place: cheap on a GPU, and fewer launches.)"""
        logits = logits[:, :self.vocab_size]
        logprob_rows = self._logprobs(logits, batch) if batch.logprob_rows else None
        if batch.processors is not None:  # in place, in the logits' dtype (`logits` may be overwritten)
            logits = logits_processors.apply(logits, batch.processors)
        if batch.grammar_masks is not None:  # after the processors: the grammar has the last word
            logits = structured_masks(logits, batch.grammar_masks, self.vocab_size)
        chosen, rest = None, batch
        if batch.fused_table is not None and self._c_kernels(logits):
            chosen, rest = self._draw_fused(logits, batch)
        if rest is None:
            return SampleResult(chosen.tolist(), self.logprob_results(logprob_rows, batch, chosen))
        seen = None  # the rows left for the general path
        if (pen := rest.penalties) is not None:
            seen = self._penalized_values(logits, pen)
            if self._triton_kernels(logits) is None:
                # A device scalar: a Python one is wrapped from host data (the test of this path counts those).
                logits.index_put_((pen.rows.view(-1, 1), pen.ids), logits.new_full((), NEG_INF))
        chosen, unsettled = self._draw(logits, rest, seen, chosen)
        # The step's one device-to-host copy: the tokens and the flags of the rows left unsettled.
        flags = unsettled.flags()
        host = torch.cat([chosen, *(f.long() for f in flags)]).tolist() if flags else chosen.tolist()
        if any(host[batch.num_rows:]):
            self._settle(logits, rest, seen, chosen, unsettled, host[batch.num_rows:])
            host = chosen.tolist()
        return SampleResult(host[:batch.num_rows], self.logprob_results(logprob_rows, batch, chosen))

    def _draw_fused(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, SamplingBatch | None]:
        """The sampled rows in the fused C kernel (penalties, candidates or whole-row weights,
        filters, draw: one pass a row). An unseeded row's key is a fresh draw from the sampler's
        generator. Returns the tokens so far and the batch narrowed to the rows left for the
        general path (greedy rows, and the rare rows the kernel hands back), or None."""
        table = batch.fused_table
        if batch.unseeded.any():
            keys = torch.randint(-2 ** 63, 2 ** 63 - 1, (int(batch.unseeded.sum()),), generator=self.generator)
            table["seed"][batch.unseeded] = keys.numpy().view(np.uint64)
        tokens = np.empty(logits.shape[0], dtype=np.int64)
        left = cpu_kernels.sample_fused(logits, table, _NO_SEEN_IDS if batch.seen_ids is None else batch.seen_ids,
                                        _NO_SEEN_COUNTS if batch.seen_counts is None else batch.seen_counts,
                                        TOP_K_TIE_ROOM, CPU_SAMPLE_ROUNDS, tokens)
        chosen = torch.from_numpy(tokens)
        if not (left or batch.greedy_rows):
            return chosen, None
        top_k_left = [j for j, row in enumerate(batch.top_k_rows) if tokens[row] < 0]
        narrowed = dataclasses.replace(
            batch, fused_table=None, _row_sets=None, top_k_rows=[batch.top_k_rows[j] for j in top_k_left],
            top_k=batch.top_k[top_k_left] if top_k_left else None,
            max_top_k=int(batch.top_k[top_k_left].max()) if top_k_left else 0,
            full_rows=[row for row in batch.full_rows if tokens[row] < 0])
        return chosen, narrowed

    def raw_logprobs(self, logits: torch.Tensor, batch: SamplingBatch):
        """What `logprob_results` needs, taken from the raw logits (before anything changes them);
        None when no row asks."""
        return self._logprobs(logits[:, :self.vocab_size], batch) if batch.logprob_rows else None

    @staticmethod
    def logprob_results(logprob_rows, batch: SamplingBatch, chosen: torch.Tensor
                        ) -> list[tuple[float, dict[int, float]] | None]:
        """Per row: (the chosen token's logprob, top-n) where the row asked, else None."""
        results: list[tuple[float, dict[int, float]] | None] = [None] * batch.num_rows
        if logprob_rows is not None:
            raw, lse, top_values, top_ids = logprob_rows
            picked = batch.row_sets().logprobs.of(chosen.to(raw.device))
            chosen_lp = (raw.gather(1, picked.view(-1, 1)).view(-1).float() - lse).tolist()
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
            for j, (row, k) in enumerate(zip(batch.logprob_rows, batch.logprob_counts)):
                results[row] = (chosen_lp[j], dict(zip(top_ids[j][:k], top_values[j][:k])))
        return results

    @torch.inference_mode()
    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Each row's distribution after every filter, as `sample` draws from it: penalties,
        temperature, top-k, top-p and min-p with the thresholds above; greedy rows one-hot at
        the argmax. Dense fp32 [rows, vocab] (`logits` is left as it is): speculative decoding
        compares a target's and a draft's distributions with it."""
        x = logits[:, :self.vocab_size].to(torch.float32, copy=True)
        if batch.processors is not None:
            x = logits_processors.apply(x, batch.processors)
        if batch.grammar_masks is not None:
            x = structured_masks(x, batch.grammar_masks, self.vocab_size)
        if batch.penalties is not None:
            x = self.apply_penalties(x, batch)
        out = torch.zeros_like(x)
        sets = batch.row_sets()
        if sets.greedy:
            out.index_copy_(0, sets.greedy.index,
                            torch.nn.functional.one_hot(sets.greedy.of(x).argmax(dim=-1), x.shape[1]).float())
        if batch.all_greedy:
            return out
        sampled = batch.row_set(sorted(batch.top_k_rows + batch.full_rows))
        w = self._unnormalized(sampled.of(x), sampled, batch)  # p / p_max (x is this call's copy)
        if batch.top_k_rows:  # each sampled row's k (0: off), gathered from the batch's rows
            ks = torch.zeros(batch.num_rows, 1, dtype=torch.int64, device=w.device)
            ks = sampled.of(ks.index_copy_(0, sets.top_k.index, batch.top_k))
            kth = w.topk(batch.max_top_k, dim=-1).values.gather(1, (ks - 1).clamp(min=0))
            w.masked_fill_((ks > 0) & (w < kth), 0.0)
        if batch.any_top_p:
            w.masked_fill_(w < self._top_p_floor(w, sampled.of(batch.top_p)), 0.0)
        w = self._min_p(w, sampled, batch)
        out.index_copy_(0, sampled.index, w / w.sum(dim=-1, keepdim=True))
        return out

    @staticmethod
    def _top_p_floor(w: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """[rows, 1]: the smallest weight in each row's top-p set (w: unnormalized weights, 0
        for tokens already out; top_p: [rows, 1]). The set is the smallest prefix by descending
        weight whose mass reaches top_p; the token that crosses it and its ties stay."""
        ordered = w.sort(dim=-1, descending=True).values
        mass_before = (ordered.cumsum(dim=-1) - ordered) / ordered.sum(dim=-1, keepdim=True)
        last = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1) - 1
        return ordered.gather(1, last)

    # ---- the vocabulary-wide primitives: C kernels on CPU, torch elsewhere ----------------------
    def _fp32(self, x: torch.Tensor) -> torch.Tensor:
        """x as fp32: itself, or a copy in a buffer kept across steps (a fresh [rows, vocab]
        fp32 tensor is large enough to be mmap'ed, and its page faults cost more than the copy)."""
        if x.dtype == torch.float32:
            return x
        if self._f32_buffer is None or self._f32_buffer.shape[0] < x.shape[0] or self._f32_buffer.device != x.device:
            self._f32_buffer = torch.empty((max(x.shape[0], 64), self.vocab_size), dtype=torch.float32, device=x.device)
        return self._f32_buffer[:x.shape[0], :x.shape[1]].copy_(x)

    def _triton_kernels(self, x: torch.Tensor):
        """kernels.sampling where the device draws on x run as Triton kernels (where the C
        kernels do not take x), else None."""
        if self._c_kernels(x):
            return None
        if self.use_triton_kernels or (self.use_triton_kernels is None and x.is_cuda):
            return _triton_sampling()
        return None

    def _c_kernels(self, x: torch.Tensor) -> bool:
        """Whether the C kernels take x (CPU, a kernel dtype, rows contiguous)."""
        return self.use_c_kernels and cpu_kernels.supports(x) and x.stride(-1) == 1

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.argmax(x) if self._c_kernels(x) else x.argmax(dim=-1)

    LSE_ROWS = 8  # rows widened to fp32 at once for their log-sum-exp (a small, cache-resident temporary)

    def _logprobs(self, logits: torch.Tensor, batch: SamplingBatch):
        """What the raw logits' (before penalties and temperature) log-softmax is needed for, asking
        rows only: logprob = logit - logsumexp(row). The rows stay in the model's dtype: on CPU
        one C pass a row gives the log-sum-exp and the top-n; elsewhere only the log-sum-exp is
        computed in fp32, a few rows at a time (a whole [rows, vocab] fp32 log-softmax costs more
        in memory traffic than the arithmetic), or in one Triton kernel where the draws are."""
        raw = batch.row_sets().logprobs.of(logits, copy=True)  # `logits` may change before they are read
        k = max(batch.logprob_counts)
        if self.use_c_kernels and cpu_kernels.supports(raw):  # one C pass a row: log-sum-exp and top-k together
            lse, values, ids, _, _ = cpu_kernels.logprob_rows(raw, k)
            return raw, lse, values, ids
        if (kernels := self._triton_kernels(raw)) is not None:
            lse = kernels.log_sum_exp(raw)
        else:
            lse = torch.empty(raw.shape[0], dtype=torch.float32, device=raw.device)
            for start in range(0, raw.shape[0], Sampler.LSE_ROWS):
                rows = raw[start:start + Sampler.LSE_ROWS]
                lse[start:start + Sampler.LSE_ROWS] = torch.logsumexp(rows.float(), dim=-1)
        values, ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
        return raw, lse, values.float() - lse[:, None], ids

    def _penalized_values(self, logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
        """`penalized_values`, one Triton kernel where the draws are."""
        if (kernels := self._triton_kernels(logits)) is not None:
            return kernels.penalized_values(logits, pen.rows, pen.ids, pen.output_counts, pen.repetition,
                                            pen.frequency, pen.presence)
        return self.penalized_values(logits, pen)

    @staticmethod
    def penalized_values(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
        """[p, L] fp32: the penalized logits of the penalized rows' seen ids, read from `logits`
        (any dtype): repetition (over prompt and output, as transformers), then frequency and
        presence (over output tokens, as OpenAI)."""
        v = logits[pen.rows.view(-1, 1), pen.ids].float()
        if pen.repetition is not None:
            v = torch.where(v > 0, v / pen.repetition, v * pen.repetition)
        if pen.frequency is not None:
            v = v - (pen.frequency * pen.output_counts + pen.presence * (pen.output_counts > 0).float())
        return v

    @staticmethod
    def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The penalized fp32 logits, in place (dense: every row of the batch)."""
        if (pen := batch.penalties) is not None:
            logits[pen.rows.view(-1, 1), pen.ids] = Sampler.penalized_values(logits, pen)
        return logits

    def _uniforms(self, batch: SamplingBatch, rows: RowSet, round_: int) -> torch.Tensor:
        """[len(rows), 1] uniforms for these rows of the batch, this rejection round: from the
        table `prepare` made off the CPU, else drawn now (seeded rows: counter-based)."""
        if batch.uniforms is not None and round_ < batch.uniforms.shape[1]:
            return rows.of(batch.uniforms)[:, round_:round_ + 1]
        u = torch.rand(len(rows), generator=self.generator, dtype=torch.float64)
        if batch.seeded_rows:
            where = {r: j for j, r in enumerate(rows)}
            picked = [(where[r], s, pos) for r, s, pos in zip(batch.seeded_rows, batch.seeds, batch.positions)
                      if r in where]
            if picked:
                index, seeds, positions = zip(*picked)
                u[list(index)] = torch.from_numpy(counter_uniforms(list(seeds), list(positions), round_))
        return u.view(-1, 1).to(self.device, non_blocking=True)

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, seen: torch.Tensor | None,
              chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, Unsettled]:
        """Every row's token on the logits' device, with no host round trip; `seen`: the penalized
        rows' penalized seen values; `chosen`: the tokens of rows already drawn, if any (the batch
        lists only the others). Returns the tokens and what is left to settle once they reach
        the host (their tokens there are placeholders)."""
        unsettled = Unsettled()
        if chosen is None and batch.all_greedy and batch.penalties is None:  # no row set needed
            return self._argmax(logits), unsettled
        sets = batch.row_sets()
        if chosen is None and batch.all_greedy:
            return self._argmax_rows(logits, sets.greedy, batch, seen), unsettled
        if chosen is None:
            chosen = torch.empty(batch.num_rows, dtype=torch.int64, device=logits.device)
        if sets.greedy:
            chosen.index_copy_(0, sets.greedy.index, self._argmax_rows(logits, sets.greedy, batch, seen))
        if sets.top_k:
            unsettled.tied = self._draw_top_k(logits, batch, chosen, seen)
        if sets.full:
            unsettled.rejected = self._draw_full(self._dense_rows(logits, sets.full, batch, seen), batch, sets.full,
                                                 chosen)
        return chosen, unsettled

    def _settle(self, logits: torch.Tensor, batch: SamplingBatch, seen: torch.Tensor | None, chosen: torch.Tensor,
                unsettled: Unsettled, flags: list[int]) -> None:
        """The rows the device pass left, exactly, on the slow path (host round trips allowed):
        whole rows rejected every round take the sort; top-k rows whose ties outgrew the
        candidates are drawn over their whole row above the k-th value. `flags`: the
        unsettled flags as they came back with the tokens."""
        tied_flags = flags[:len(batch.top_k_rows)] if unsettled.tied is not None else []
        if unsettled.rejected is not None:  # first: its weights may sit in the fp32 buffer
            self._sort_rejected(unsettled.rejected, flags[len(tied_flags):], batch, chosen)
        tied = [row for row, flag in zip(batch.top_k_rows, tied_flags) if flag]
        if tied:
            rows = batch.row_set(tied)
            rejected = self._draw_full(self._dense_rows(logits, rows, batch, seen), batch, rows, chosen, tied=True)
            if rejected is not None:
                self._sort_rejected(rejected, rejected.pending.tolist(), batch, chosen)

    def _argmax_rows(self, logits: torch.Tensor, rows: RowSet, batch: SamplingBatch,
                     seen: torch.Tensor | None) -> torch.Tensor:
        """These rows' argmax (the first index of the largest value, as torch.argmax), penalties
        included: the masked row's argmax against the best of its seen ids (where the draws are
        Triton kernels, the densely penalized rows' argmax: 4 launches, not 20)."""
        if rows.penalized is not None and self._triton_kernels(logits) is not None:
            return self._argmax(self._dense_rows(logits, rows, batch, seen))
        x = rows.of(logits)
        chosen = self._argmax(x)
        if rows.penalized is not None:
            pen, prow, local = batch.penalties, rows.penalty_rows, rows.penalized
            values = seen[prow].masked_fill(~pen.distinct[prow], NEG_INF)
            best_seen = values.max(dim=-1).values
            # The smallest id of the ties, as torch.argmax would pick (seen ids are not sorted).
            seen_id = pen.ids[prow].masked_fill(values != best_seen[:, None], self.vocab_size).min(dim=-1).values
            unseen_id = chosen[local]
            best_unseen = x[local].gather(1, unseen_id.view(-1, 1)).view(-1).float()
            take = (best_seen > best_unseen) | ((best_seen == best_unseen) & (seen_id < unseen_id))
            chosen[local] = torch.where(take, seen_id, unseen_id)
        return chosen

    def _dense_rows(self, logits: torch.Tensor, rows: RowSet, batch: SamplingBatch,
                    seen: torch.Tensor | None) -> torch.Tensor:
        """These rows whole, penalized: an fp32 copy with the seen values written back where any
        row has penalties, else the rows as they are."""
        x = rows.of(logits)
        if rows.penalized is None:
            return x
        x = self._fp32(x)
        x[rows.penalized.view(-1, 1), batch.penalties.ids[rows.penalty_rows]] = seen[rows.penalty_rows]
        return x

    def _candidates(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's k largest values and every value tied with its k-th (the kept set keeps
        ties, and bf16 logits tie often), up to TOP_K_TIE_ROOM of them: (fp32 values sorted
        descending, -inf as padding; ids; complete: whether the row's candidates hold every such
        value, else it takes the full path). On CPU one C pass; elsewhere one topk."""
        if self._c_kernels(x):
            values, ids, counts = cpu_kernels.topk_with_ties(x, k, k + TOP_K_TIE_ROOM)
            return values, ids, counts >= 0
        width = min(k + TOP_K_TIE_ROOM, x.shape[1])
        values, ids = x.topk(width, dim=-1)
        values = values.float()
        kth = values[:, k - 1]
        if width == x.shape[1]:
            return values, ids, torch.ones_like(kth, dtype=torch.bool)
        # A -inf k-th: fewer finite values than k, all of them among the candidates.
        return values, ids, (values[:, -1] < kth) | (kth == NEG_INF)

    def _draw_top_k(self, logits: torch.Tensor, batch: SamplingBatch, chosen: torch.Tensor,
                    seen: torch.Tensor | None) -> torch.Tensor:
        """Rows with top-k: sample among their candidates (the k-th value's ties included).
        Returns [len(top_k rows)] bool: the rows whose ties did not fit the candidates (their
        tokens are placeholders; they take the full-row path once the flags reach the host)."""
        rows = batch.row_sets().top_k
        if (kernels := self._triton_kernels(logits)) is not None:  # candidates of the densely penalized rows
            x = self._dense_rows(logits, rows, batch, seen)
            values, ids = x.topk(min(batch.max_top_k + TOP_K_TIE_ROOM, x.shape[1]), dim=-1)
            return kernels.sample_candidates(values, ids, rows.index, batch.top_k, batch.temperature,
                                             batch.top_p if batch.any_top_p else None,
                                             batch.log_min_p if batch.any_min_p else None, batch.uniforms, chosen,
                                             all_candidates=values.shape[1] == x.shape[1])
        # Temperature scaling keeps the order: pick candidates first, then scale them.
        values, ids, complete = self._candidates(rows.of(logits), batch.max_top_k)
        values, ids, complete = self._with_seen(values, ids, complete, rows, batch, seen)
        width = values.shape[1]
        values = values / rows.of(batch.temperature)
        kth = values.gather(1, batch.top_k - 1)
        keep = values >= kth
        if batch.any_top_p:
            probs = torch.softmax(values.masked_fill(~keep, NEG_INF), dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # The kept prefix ends at the crossing token; its ties stay (threshold semantics).
            last = (mass_before < rows.of(batch.top_p)).sum(dim=-1, keepdim=True).clamp(min=1) - 1
            keep &= values >= values.gather(1, last)
        if batch.any_min_p:
            keep &= values >= values[:, :1] + rows.of(batch.log_min_p)
        weights = torch.exp(values - values[:, :1]).masked_fill_(~keep, 0.0)
        cdf = weights.cumsum(dim=-1)
        u = self._uniforms(batch, rows, 0)
        index = torch.searchsorted(cdf, u.to(cdf.dtype) * cdf[:, -1:], right=True).clamp_(max=width - 1)
        chosen.index_copy_(0, rows.index, ids.gather(1, index).view(-1))
        return ~complete

    def _with_seen(self, values: torch.Tensor, ids: torch.Tensor, complete: torch.Tensor, rows: RowSet,
                   batch: SamplingBatch, seen: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidates of masked rows merged with their seen ids' penalized values: the largest
        k + MERGED_TIE_ROOM of both, sorted. The merged k-th value is at least the masked row's,
        so every value tied with it is among the merged ones; a row whose ties do not fit that
        width is marked incomplete (it takes the full-row path). A top-k of the merged rows, not
        a sort: 4x faster at 32 rows x (k + 256 + 400 seen ids)."""
        if rows.penalized is None:
            return values, ids, complete
        pen, prow = batch.penalties, rows.penalty_rows
        width = pen.ids.shape[1]
        extra = torch.full((len(rows), width), NEG_INF, device=values.device)
        extra[rows.penalized] = seen[prow].masked_fill(~pen.distinct[prow], NEG_INF)
        extra_ids = torch.zeros((len(rows), width), dtype=ids.dtype, device=ids.device)
        extra_ids[rows.penalized] = pen.ids[prow]
        kept = min(values.shape[1], batch.max_top_k + MERGED_TIE_ROOM)
        merged, order = torch.cat([values, extra], dim=1).topk(kept + 1, dim=1)
        # The largest value left out must be below the k-th, or ties of the k-th were cut (a -inf
        # k-th: fewer finite values than k, all of them kept).
        kth = merged[:, batch.max_top_k - 1]
        complete = complete & ((merged[:, kept] < kth) | (kth == NEG_INF))
        order = order[:, :kept]
        return merged[:, :kept], torch.cat([ids, extra_ids], dim=1).gather(1, order), complete

    def _draw_full(self, x: torch.Tensor, batch: SamplingBatch, rows: RowSet, chosen: torch.Tensor,
                   tied: bool = False) -> Rejected | None:
        """Inverse-CDF sampling over whole rows (`x`: those rows, penalized); top-p by rejection
        against a rising pivot; `tied`: top-k rows whose ties outgrew the candidates (the k-th
        value bounds them). Returns the rows every round rejected (None when none can be).

        On CPU one C pass per row does the first rounds; on CUDA one Triton program per row does
        the device rounds; elsewhere, and for a row the C rounds all rejected, torch on
        w = exp((logit - max) / T), the unnormalized probabilities (largest 1), for every row at
        once (no host round trip between rounds): the thresholds compare probabilities."""
        if not tied and (kernels := self._triton_kernels(x)) is not None:
            pending = kernels.sample_whole_rows(x, rows.index, batch.temperature,
                                                batch.top_p if batch.any_top_p else None,
                                                batch.log_min_p if batch.any_min_p else None, batch.uniforms, chosen)
            return Rejected(rows, pending, rows.of(batch.top_p), x=x) if batch.any_top_p else None
        first_round = 0
        if self._c_kernels(x):
            picked = self._draw_full_cpu(x, batch, rows, tied)
            left = (picked < 0).nonzero().view(-1)
            done = (picked >= 0).nonzero().view(-1)
            chosen[rows.index[done]] = picked[done]
            if not len(left):
                return None
            rows, first_round, x = batch.row_set([rows.rows[j] for j in left.tolist()]), CPU_SAMPLE_ROUNDS, x[left]
        w = self._unnormalized(self._fp32(x), rows, batch)  # in place: x is an fp32 copy, or fp32 logits
        if tied:  # the k-th value's threshold over the whole row (only after the host has the flags)
            where = {r: j for j, r in enumerate(batch.top_k_rows)}
            ks = batch.top_k[[where[r] for r in rows]]
            w.masked_fill_(w < w.topk(int(ks.max()), dim=-1).values.gather(1, ks - 1), 0.0)
        sample_w = self._min_p(w, rows, batch)
        if not batch.any_top_p:
            chosen.index_copy_(0, rows.index, self._inverse_cdf(sample_w, self._uniforms(batch, rows, first_round)))
            return None
        top_p = rows.of(batch.top_p)
        threshold = top_p * w.sum(dim=-1, keepdim=True)  # top-p mass, unnormalized
        pending = torch.ones(len(rows), dtype=torch.bool, device=w.device)
        token = torch.zeros(len(rows), dtype=torch.int64, device=w.device)
        pivoted = sample_w.clone()  # sample_w above each row's pivot; w and sample_w stay for the sort
        for round_ in range(DEVICE_REJECTION_ROUNDS):
            index = self._inverse_cdf(pivoted, self._uniforms(batch, rows, first_round + round_)).view(-1, 1)
            value = w.gather(1, index)
            # Inside the top-p set iff the mass strictly above the token is below top_p.
            accept = (w.masked_fill(w <= value, 0.0).sum(dim=-1, keepdim=True) < threshold).view(-1) & pending
            token = torch.where(accept, index.view(-1), token)
            pending &= ~accept
            # Everything at or below a rejected token is outside the top-p set: raise the pivot.
            pivoted.masked_fill_((w <= value) & pending.view(-1, 1), 0.0)
        chosen.index_copy_(0, rows.index, token)
        return Rejected(rows, pending, top_p, w, sample_w)

    @staticmethod
    def _unnormalized(w: torch.Tensor, rows: RowSet, batch: SamplingBatch) -> torch.Tensor:
        """w = exp((logit - max) / T) in place (fp32 rows): the probabilities over the largest."""
        return w.sub_(w.max(dim=-1, keepdim=True).values).div_(rows.of(batch.temperature)).exp_()

    @staticmethod
    def _min_p(w: torch.Tensor, rows: RowSet, batch: SamplingBatch) -> torch.Tensor:
        """w with the tokens below min-p zeroed (p / p_max = w); w itself without min-p."""
        return w.masked_fill(w < rows.of(batch.log_min_p).exp(), 0.0) if batch.any_min_p else w

    @staticmethod
    def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """[rows]: each row's draw from its unnormalized weights, u: [rows, 1] uniforms."""
        cdf = weights.cumsum(dim=-1)
        index = torch.searchsorted(cdf, u.to(cdf.dtype) * cdf[:, -1:], right=True)
        return index.clamp_(max=weights.shape[1] - 1).view(-1)

    def _sort_rejected(self, rejected: Rejected, flags: list[int], batch: SamplingBatch, chosen: torch.Tensor) -> None:
        """The exact fallback for the rows every rejection round rejected: sort those rows."""
        pending = [j for j, flag in enumerate(flags) if flag]
        if not pending:
            return
        rows = batch.row_set([rejected.rows.rows[j] for j in pending])
        at = torch.tensor(pending, device=rejected.pending.device)
        if rejected.w is None:  # drawn by the Triton kernel, which kept no weights
            w = self._unnormalized(rejected.x.index_select(0, at).float(), rows, batch)
            sample_w = self._min_p(w, rows, batch)
        else:
            w, sample_w = rejected.w.index_select(0, at), rejected.sample_w.index_select(0, at)
        weights = sample_w.masked_fill(w < self._top_p_floor(w, rejected.top_p.index_select(0, at)), 0.0)
        chosen.index_copy_(0, rows.index, self._inverse_cdf(weights, self._uniforms(batch, rows, SORT_ROUND)))

    def _draw_full_cpu(self, x: torch.Tensor, batch: SamplingBatch, rows: RowSet, tied: bool) -> torch.Tensor:
        """The first CPU_SAMPLE_ROUNDS draws of every row in the C kernel; -1 where all were
        rejected."""
        n = len(rows)
        floor = torch.full((n,), NEG_INF)
        if tied:  # the k-th raw value bounds the row from below
            where = {r: j for j, r in enumerate(batch.top_k_rows)}
            for j, r in enumerate(rows):
                floor[j] = x[j].float().topk(int(batch.top_k[where[r]])).values[-1]
        temperature = rows.of(batch.temperature).view(-1)
        min_p = rows.of(batch.log_min_p).exp().view(-1) if batch.any_min_p else torch.zeros(n)
        top_p = rows.of(batch.top_p).view(-1) if batch.any_top_p else torch.ones(n)
        uniforms = torch.cat([self._uniforms(batch, rows, round_) for round_ in range(CPU_SAMPLE_ROUNDS)], dim=1)
        return cpu_kernels.sample_rows(x, temperature, min_p, top_p, floor, uniforms)


@dataclass
class Rejected:
    """Whole rows with top-p that every device rejection round rejected (`pending`, bool), with
    what the exact sort needs: their weights (w: p / p_max; sample_w: the same after min-p), or
    the rows' logits (x) when a Triton kernel drew them."""

    rows: RowSet
    pending: torch.Tensor
    top_p: torch.Tensor
    w: torch.Tensor | None = None
    sample_w: torch.Tensor | None = None
    x: torch.Tensor | None = None


@dataclass
class Unsettled:
    """What a device pass leaves for after the step's tokens reach the host: flags of the top-k
    rows whose ties outgrew the candidates, and the whole rows every rejection round rejected."""

    tied: torch.Tensor | None = None  # [len(top_k rows)] bool
    rejected: Rejected | None = None

    def flags(self) -> list[torch.Tensor]:
        """The flags to copy to the host with the tokens, in this order."""
        return [f for f in (self.tied, self.rejected.pending if self.rejected else None) if f is not None]
