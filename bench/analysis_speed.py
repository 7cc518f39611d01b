"""Benchmark: each streamed analysis beside the bare map computation of the same model, precision and inputs, in one
run (issue 43).

    python bench/analysis_speed.py [--encoder minilm] [--sentences 1000] [--threads 1] [--device cpu|cuda]
        [--precision 32-true|bf16-mixed] [--analyses head_stats sink] [--rounds 3] [--data-dir DIR] [--out f.json]
        [--ops [--device-steps]]

``--ops``: also the operators each dispatches per 1,000 pieces (one more untimed run of each under torch's profiler:
on a GPU each is a launch, a few microseconds of host time however small its work); ``--device-steps`` counts them
with the reductions' work cut as on an accelerator (:func:`device_steps`), so that a CPU gives a GPU's count.

Inputs: the first ``--sentences`` sentences of UD EWT dev (``--split``; 0: all), read as each analysis reads them:
``head_stats`` Clark's pairs of consecutive sentences of a document (its default input; ``head_stats_single``: each
sentence alone), ``sink`` the windows of 64 pieces of the split's running text (as many as the sentences' pieces
fill), ``clustering`` the pairs of head_stats; ``head_stats_loop``: head_stats' pairs through the per-sentence path it had
before (every sequence's (L, H, T, T) map handed to ``HeadStatsAccumulator.add``), for comparison; ``dep_heads`` each
sentence alone, scored from an attention cache of them built (in a temporary folder) before the rounds;
``coref_heads`` the segments of its default source, UD GUM ``--split`` (the first documents holding at least
``--sentences`` sentences, singletons removed, whole sentences packed within the model's length), scored from a
cache of them built before the rounds: of the mention heads' rows only, as the analysis keeps by default
(``coref_heads``), or of whole maps (``coref_heads_whole``, for comparison);
``pattern_types`` and ``linguistic_attention`` each sentence alone (linguistic_attention's token kinds and relations
on the gold UD labels, its ``source=treebank``).
``--encoder``: the extraction bench's choices (``extract_speed.load_bench_encoder``: ``minilm``,
``bert-base-random``: bert-base's shape with random weights and the MiniLM vocabulary, no download; or a folder).

``--precision bf16-mixed``: the whole model held in bf16 (:func:`probes.model.frozen.compute_in`, as the extraction
stage computes at ``bf16-mixed``, and what ``encoder.dtype=bfloat16`` gives an analysis of a live model), without
autocast, as the analyses run: their reductions compute in their own dtypes (the caches of dep_heads and coref_heads
are built by the extraction stage at that precision, its autocast included).

For each analysis, in alternation for ``--rounds`` rounds (the best of each kept), on the same inputs and batches:

* ``bare``: the map computation alone: every layer's attention probabilities computed on the project's attention
  path (``MapEngine.iter_reduced_batches`` with a reducer that does nothing), what any analysis of the maps pays;
* the analysis's own computation: ``head_stats``: :func:`probes.analysis.clark.head_stats.sequence_stats` and its
  result on the host; ``sink``: :func:`probes.analysis.beyond.sink.first_token_alpha`; ``clustering``:
  :func:`probes.analysis.clark.clustering.head_distances` and its results on the host; ``dep_heads``:
  :func:`probes.analysis.clark.dep_heads.evaluate` on the cache (the scoring, timed alone; reported as bare plus it:
  the maps an extraction computes, then their scoring; ``scoring_*`` the scoring alone); ``coref_heads``,
  ``coref_heads_whole``: :func:`probes.analysis.clark.coref_heads.evaluate` on its cache, the same way;
  ``pattern_types``: :func:`probes.analysis.kovaleva.pattern_types.head_predictions` with a CNN of the default shape
  and random weights (the work of a trained one); ``linguistic_attention``: its scoring of one model
  (``probes.analysis.kovaleva.linguistic_attention.scoring._run_one``) with the paper's kinds and relations.

Reported: pieces (tokens) per second of wall time, the analysis's throughput over bare's, CPU seconds (the main
thread's: with ``--threads 1`` every CPU kernel runs there; the memory sampler's thread is not counted), the CPU-s
per 1,000 sentences (inputs) the analysis adds to bare's, split into its reductions' tensor operators (the CPU time
inside the reducers' ``start``, ``update`` and ``batch_results``, ``DepAccumulator.add_batch`` and
``CorefAccumulator.add_batch``,
linguistic_attention's ``batch_scores``, pattern_types' ``classify_batch`` (the CNN on a batch's length groups) and
the stacking of a batch's piece maps into one tensor (``probes.maps.engine.stacked_maps``), :func:`timed_updates`:
on a GPU the device's work) and the rest, its host work (flags, batching, Python: what stays on the CPU beside a
GPU). The host work is given twice: as that rest (the analysis's CPU less bare's and the reductions: the forward's
variation between the two runs, a few tenths of a CPU-s, in it) and outside the forwards, each run's own
(:func:`host_outside_forward`: a run's CPU less the time inside the model's forwards, ``Attention.reduce`` and
``layer_maps``, and less its reductions; the analysis's less bare's). The throughput is also given without the
forward's variation (``own_costs_ratio``): bare's CPU over bare's plus the analysis's reductions and host work
outside the forwards. Also the high-water mark of the process's own
anonymous memory during each (:class:`probes.memory.AnonPeak`) and, on CUDA, the peak GPU memory
(``torch.cuda.max_memory_allocated``). For the analyses that read a cache, its extraction before the rounds
(``cache``: wall and process CPU seconds, its threads included, anonymous-memory peak, bytes written). The CPU is
named (:func:`probes.machine.cpu_description`) beside the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from probes.analysis.beyond.sink import first_token_alpha, running_split_text, text_windows  # noqa: E402
from probes.analysis.clark import coref_heads, dep_heads, head_stats  # noqa: E402
from probes.analysis.clark.clustering import head_distances  # noqa: E402
from probes.analysis.clark.metrics import DepAccumulator, HeadStatsAccumulator, is_causal  # noqa: E402
from probes.data.coref import read_gum_coref  # noqa: E402
from probes.extract import runner  # noqa: E402
from probes.extract.stage import AttentionMaps  # noqa: E402
from probes.maps import encode_all  # noqa: E402
from probes.analysis.kovaleva import pattern_types  # noqa: E402
from probes.analysis.kovaleva.linguistic_attention import scoring  # noqa: E402
from probes.analysis.kovaleva.linguistic_attention.examples import treebank_items  # noqa: E402
from probes.analysis.kovaleva.linguistic_attention.rules import KindRules  # noqa: E402
from probes.patterns import module as pattern_module  # noqa: E402
from probes.patterns.module import PatternClassifier  # noqa: E402
from probes.config import compose, plain  # noqa: E402
from probes.data.sources import Treebank  # noqa: E402
from probes.extract.attention_caches import ensure_cache  # noqa: E402
from probes.extract.settings import ExtractSettings  # noqa: E402
from probes.data.conllu import read_conllu  # noqa: E402
from probes.machine import cpu_description  # noqa: E402
from probes.maps import MapEngine, pad_id_of  # noqa: E402
from probes.maps import engine as engine_module  # noqa: E402
from probes.maps.reducers import HeadDistances, HeadStats, Reducer  # noqa: E402
from probes.measures.attention import Attention  # noqa: E402
from probes.memory import AnonPeak  # noqa: E402
from probes.model.frozen import compute_in  # noqa: E402
from extract_speed import load_bench_encoder  # noqa: E402  (the same encoders as the extraction bench)

ANALYSES = ("head_stats", "head_stats_single", "sink", "clustering", "head_stats_loop", "dep_heads", "coref_heads",
            "coref_heads_whole", "pattern_types", "linguistic_attention")
COREF = ("coref_heads", "coref_heads_whole")  # the cache of the mention heads' rows (the analysis's), of whole maps
CACHED = ("dep_heads",) + COREF
# linguistic_attention's node keys that KindRules.from_config takes
RULE_ARGS = ("feature_set", "feature_sets", "features", "piece_pooling", "missing", "missing_by_feature", "relations",
             "relation_missing")  # analyses that read the attention cache: built before the rounds, the scoring timed


class Nothing(Reducer):
    """A reducer that keeps nothing: the engine still computes every layer's attention and hands it over."""

    def nbytes(self, layers, heads, positions, items, device=None) -> int:
        return 0

    def start(self, layers, heads, positions, items, T, device) -> None:
        self._set_layers(layers, heads)

    def update(self, layer, probs, rows, cols) -> None:
        pass

    def batch_results(self) -> dict:
        return {}


@contextlib.contextmanager
def timed_updates(out: dict):
    """Time (main thread's CPU) every ``update`` and ``batch_results`` of the reducers while inside: the reductions'
    tensor operators (on a GPU the device's work), so that the rest of the analysis's CPU beyond bare's is its host
    work. Also the forwards (``Attention.reduce`` and ``layer_maps``: the model's forward with the reducers' updates
    inside it) and the reductions inside them, so that the host work outside the forward can be read off each run
    without the forward's own variation between runs (:func:`host_outside_forward`)."""
    # the reductions: the reducers' starts (their masks and initial maps) and updates, the batched scoring of
    # dep_heads, linguistic_attention and the CNN (a batch's length groups gathered and classified), and stacking a
    # batch's piece maps into one tensor (MapEngine.iter_piece_map_batches): the maps' device's work
    reductions = {(owner, name): getattr(owner, name)
                  for owner, names in ((HeadStats, ("start", "update", "batch_results")),
                                       (HeadDistances, ("start", "update", "batch_results")),
                                       (DepAccumulator, ("add_batch",)), (coref_heads.CorefAccumulator, ("add_batch",)),
                                       (scoring, ("batch_scores",)),
                                       (pattern_types, ("classify_batch",)), (engine_module, ("stacked_maps",)))
                  for name in names}
    forwards = {(Attention, name): getattr(Attention, name) for name in ("reduce", "layer_maps")}
    inside = [0]  # depth of forward calls

    def timed(original, forward: bool):
        def call(*args, **kwargs):
            t = time.thread_time()
            inside[0] += forward
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] -= forward
                spent = time.thread_time() - t
                if forward:
                    out["forward_cpu_s"] = out.get("forward_cpu_s", 0.0) + spent
                else:
                    out["reductions_cpu_s"] = out.get("reductions_cpu_s", 0.0) + spent
                    if inside[0]:
                        out["reductions_in_forward_cpu_s"] = out.get("reductions_in_forward_cpu_s", 0.0) + spent
        return call

    originals = {**{k: (v, False) for k, v in reductions.items()}, **{k: (v, True) for k, v in forwards.items()}}
    for (owner, name), (original, forward) in originals.items():
        setattr(owner, name, timed(original, forward))
    try:
        yield
    finally:
        for (owner, name), (original, _) in originals.items():
            setattr(owner, name, original)


def host_outside_forward(m: dict) -> float:
    """A run's CPU-s outside the model's forward and the reductions: its host work (and, for bare, the engine's own)."""
    forward = m.get("forward_cpu_s", 0.0) - m.get("reductions_in_forward_cpu_s", 0.0)
    return m["cpu_s"] - forward - m.get("reductions_cpu_s", 0.0)


@contextlib.contextmanager
def device_steps():
    """Inside: the reductions cut their work as on an accelerator whatever the device (HeadStats' and HeadDistances'
    chunks, HeadDistances' blocks of pairs, the pattern CNN's steps and batches), so that a CPU counts the operations
    a GPU dispatches (``--ops --device-steps``; the counts, not the times, are a GPU's)."""
    settings = [(HeadStats, "CPU_CHUNK_ELEMENTS", HeadStats.GPU_CHUNK_ELEMENTS),
                (HeadDistances, "CPU_CHUNK_ELEMENTS", HeadDistances.GPU_CHUNK_ELEMENTS),
                (HeadDistances, "_by_pair_blocks",
                 lambda self, device: True if self.pair_blocks is None else self.pair_blocks),
                (pattern_module, "CPU_BATCH_MAPS", pattern_module.DEVICE_BATCH_MAPS),
                (pattern_module, "CPU_PREPROCESS_ELEMENTS", pattern_module.DEVICE_PREPROCESS_ELEMENTS)]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in settings]
    try:
        for owner, name, value in settings:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def dispatched(run, device: str) -> dict:
    """The operations one more (untimed) ``run()`` dispatches, under torch's profiler: the top-level aten operators
    (those not called by another; each costs the host a dispatch, and on a GPU most are a kernel launch, a few
    microseconds of host time each however small the work) and, on CUDA, the kernels the device ran."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    top = sum(1 for e in events if e.name.startswith("aten::")
              and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    out = dict(aten_ops=top)
    if device == "cuda":
        out["kernels"] = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return out


@contextlib.contextmanager
def measured(out: dict, device: str):
    """Wall seconds, the main thread's CPU seconds, the anonymous-memory peak (MiB) and the CUDA peak (GiB)."""
    anon = AnonPeak()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    w0, c0 = time.perf_counter(), time.thread_time()
    yield
    if device == "cuda":
        torch.cuda.synchronize()
    out.update(seconds=time.perf_counter() - w0, cpu_s=time.thread_time() - c0, anon_peak_mib=round(anon.read(), 1))
    anon.close()
    if device == "cuda":
        out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)


def coref_data(enc, data_dir: str, split: str, n: int):
    """(documents, segments) of coref_heads' default source: UD GUM ``split``'s documents (singletons removed), the
    first ones holding at least ``n`` sentences, packed into segments of at most the model's length."""
    docs, total = [], 0
    for d in read_gum_coref(Path(data_dir) / "ud_english_gum" / f"en_gum-ud-{split}.conllu"):
        if total >= n:
            break
        docs.append(d.without_singletons())
        total += len(d.sentences)
    segments, _ = coref_heads.document_segments(enc.tokenizer, docs, enc.max_length)
    return docs, segments


def inputs_of(analysis: str, enc, sentences, coref=None):
    """(encoded inputs, the number of sentences they hold) as the analysis reads them (linguistic_attention: its
    labelled examples, their ``encoded`` the inputs; coref_heads: ``coref``'s segments)."""
    if analysis in COREF:
        docs, segments = coref
        words = coref_heads.coref_source(docs, segments, "gum", "bench", "-", None).words()
        return encode_all(enc.tokenizer, words), sum(g.last_sentence - g.first_sentence for g in segments)
    if analysis == "linguistic_attention":
        items = [it for it in treebank_items(enc.tokenizer, sentences) if it.encoded.n_pieces <= enc.max_length]
        return items, len(items)
    if analysis == "sink":
        windows = text_windows(enc.tokenizer, running_split_text(sentences), 64, None, what="the sentences")
        return windows, len(sentences)
    encoded, members = head_stats.encode_inputs(enc.tokenizer, sentences,
                                                analysis in ("head_stats", "clustering", "head_stats_loop"))
    keep = [k for k, e in enumerate(encoded) if e.n_pieces <= enc.max_length]
    return [encoded[k] for k in keep], sum(len(members[k]) for k in keep)


@functools.lru_cache(maxsize=1)
def linguistic_rules() -> KindRules:
    """The paper's token kinds and relations (conf/analysis/linguistic_attention.yaml), composed once."""
    node = plain(compose("analyze", ["analysis=linguistic_attention"]).analysis)
    return KindRules.from_config(**{k: v for k, v in node.items() if k in RULE_ARGS})


@functools.lru_cache(maxsize=1)
def bench_classifier() -> PatternClassifier:
    """A pattern CNN of the default shape, random weights (the work of a trained one), built once, as the analysis
    loads its classifier once."""
    torch.manual_seed(0)
    return PatternClassifier(class_weighting="none").eval()


def run_analysis(analysis: str, enc, items, device: str, max_tokens: int, max_batch_size: int, cached=None):
    if analysis in COREF:  # the scoring of the cached segment maps or mention rows (the cache built before)
        cache, docs, segments = cached
        return coref_heads.evaluate(cache, docs, segments, device, progress=False).count
    if analysis == "dep_heads":  # the scoring of the cached word maps (the cache built before)
        cache, sentences = cached
        return dep_heads.evaluate(cache, sentences, cache.num_layers, cache.num_heads, progress=False,
                                  causal=is_causal(enc), device=device).count
    if analysis == "pattern_types":  # a CNN of the default shape, random weights: the same work as a trained one
        return pattern_types.head_predictions(bench_classifier(), enc.model, items, device, max_tokens, progress=False,
                                              pad_id=pad_id_of(enc.tokenizer))
    if analysis == "linguistic_attention":  # the paper's token kinds and relations on gold UD labels
        return scoring._run_one(argparse.Namespace(device=device), items, enc.model, enc.tokenizer, linguistic_rules(),
                                max_tokens, "linguistic_attention")[0].count
    if analysis == "sink":
        return first_token_alpha(enc, items, device, max_batch_size=max_batch_size, max_tokens=max_tokens)
    if analysis == "head_stats_loop":  # the per-sentence path head_stats had before the reducers, for comparison
        acc = HeadStatsAccumulator(is_causal(enc))
        for _, attn, punct, sep in head_stats.sequence_attention(enc, items, device, max_tokens=max_tokens,
                                                                 max_batch_size=max_batch_size, desc="loop"):
            acc.add(attn, punct, sep)
        return acc.result()
    if analysis == "clustering":
        totals = head_distances(enc, items, device=device, max_tokens=max_tokens, max_batch_size=max_batch_size)
        return totals.js.cpu(), totals.stats.result()
    acc, _, _ = head_stats.sequence_stats(enc, items, device, max_tokens=max_tokens, max_batch_size=max_batch_size)
    return acc.result()


def build_cache(enc, path: Path, n: int, precision: str, cache_dir: Path):
    """(attention cache, sentences) of the first ``n`` sentences of the treebank file ``path`` (the project's
    extraction stage, conf/extract at ``precision``), for the analyses that read the cache."""
    cfg = compose("analyze", [f"extract.precision={precision}"])
    split = path.stem.rsplit("-", 1)[-1]
    tb = Treebank(name=path.parent.name, data_dir=str(path.parent.parent), subdir=path.parent.name,
                  files={split: path.name}, download=False)
    return ensure_cache(enc, tb, split, ExtractSettings.from_config(cfg.extract), cache_dir, max_sentences=n)


def build_coref_cache(enc, coref, precision: str, cache_dir: Path, mention_rows_only: bool = True):
    """(attention cache, documents, segments): coref_heads' cache of the segments (the project's extraction stage,
    conf/extract at ``precision``, segments within the model's length): the mention heads' rows, as the analysis
    keeps by default (``mention_rows_only``), or whole maps."""
    docs, segments = coref
    cfg = compose("analyze", [f"extract.precision={precision}"])
    settings = ExtractSettings.from_config(cfg.extract).replace(max_length=enc.max_length, long_sentences="error")
    source = coref_heads.coref_source(docs, segments, "gum", "bench", "-", None)
    rows = coref_heads.mention_rows(coref_heads.document_items(docs, segments)) if mention_rows_only else None
    return runner.build(enc, AttentionMaps(rows), source, settings, cache_dir), docs, segments


def run_bare(enc, items, device: str, max_tokens: int, max_batch_size: int) -> None:
    engine = MapEngine(enc.model, Attention(), tokenizer=enc.tokenizer, device=device, max_tokens=max_tokens,
                       max_batch_size=max_batch_size, max_pairs=None)
    for _ in engine.iter_reduced_batches(items, Nothing(), desc="bare", progress=False):
        pass
    if device == "cuda":
        torch.cuda.synchronize()


def parser() -> argparse.ArgumentParser:
    """The bench's arguments (bench/device/check.sh's commands are checked against them by the tests)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder", default="minilm")
    ap.add_argument("--sentences", type=int, default=1000, help="the first N sentences of the split (0: all)")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    ap.add_argument("--analyses", nargs="+", default=["head_stats", "sink"], choices=ANALYSES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--data-dir", default=os.environ.get("PROBES_DATA_DIR", str(REPO_ROOT.parent / "shared/data")))
    ap.add_argument("--ops", action="store_true",
                    help="also count, in one more untimed run of each, the operators dispatched (and on CUDA the "
                         "kernels) per 1,000 pieces")
    ap.add_argument("--device-steps", action="store_true",
                    help="with --ops: count with the reductions' work cut as on an accelerator (chunks, blocks of "
                         "pairs, the pattern CNN's steps), whatever --device: a GPU's operations counted on a CPU")
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    if args.sentences < 0:
        ap.error(f"--sentences must be >= 0 (0: all), got {args.sentences}")
    if args.device_steps and not args.ops:
        ap.error("--device-steps changes only the operator count: give --ops with it")
    torch.set_num_threads(args.threads)
    path = Path(args.data_dir) / "ud_english_ewt" / f"en_ewt-ud-{args.split}.conllu"
    sentences = read_conllu(path)
    sentences = sentences[:args.sentences] if args.sentences > 0 else sentences
    enc = load_bench_encoder(args.encoder)
    machine = cpu_description()
    print(f"{machine}; torch {torch.__version__}, {args.threads} thread(s); {enc.name} on {args.device}, "
          f"{args.precision}; {len(sentences)} sentences of {path.name}", flush=True)
    results = dict(machine=machine, torch=torch.__version__, threads=args.threads, encoder=enc.name,
                   device=args.device, precision=args.precision, sentences=len(sentences), split=args.split,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), analyses={},
                   **(dict(ops_with_device_steps=True) if args.ops and args.device_steps else {}))
    kw = dict(max_tokens=args.max_tokens, max_batch_size=args.max_batch_size)
    # bf16-mixed: the whole model held in bf16 (what encoder.dtype=bfloat16 gives a streamed analysis), no autocast, as
    # the analyses run: the reductions compute in their own dtypes (under autocast their float32 matmuls went bf16)
    with compute_in(enc.model, args.precision), tempfile.TemporaryDirectory(prefix="analysis-speed-") as tmp:
        for analysis in args.analyses:
            coref = (coref_data(enc, args.data_dir, args.split, len(sentences)) if analysis in COREF
                     else None)
            items, n_sentences = inputs_of(analysis, enc, sentences, coref)
            if analysis == "linguistic_attention":
                linguistic_rules()  # composed before the rounds
            if analysis == "pattern_types":
                bench_classifier().inference_net()  # built before the rounds
            cached, built = None, {}
            if analysis in CACHED:  # the cache's extraction, measured (not part of the rounds)
                p0 = time.process_time()  # the extraction's background threads (batches ahead, writes) included
                with measured(built, args.device):
                    cached = (build_coref_cache(enc, coref, args.precision, Path(tmp), analysis == "coref_heads")
                              if analysis in COREF
                              else build_cache(enc, path, len(sentences), args.precision, Path(tmp)))
                built.update(process_cpu_s=round(time.process_time() - p0, 3), bytes=cached[0].manifest["bytes"])
                print(f"{analysis}: cache of {built['bytes'] / 1e6:.0f} MB extracted in {built['seconds']:.2f} s "
                      f"({built['process_cpu_s']:.2f} CPU-s of the process, anon peak {built['anon_peak_mib']} MiB)",
                      flush=True)
            encoded = [getattr(e, "encoded", e) for e in items]  # (linguistic_attention's examples: their encoding)
            pieces = sum(e.n_pieces for e in encoded)
            run_bare(enc, encoded[:8], args.device, **kw)  # warm-up
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for which in ("bare", analysis):
                    m: dict = {}
                    with measured(m, args.device):
                        with timed_updates(m):
                            if which == "bare":
                                run_bare(enc, encoded, args.device, **kw)
                            else:
                                run_analysis(analysis, enc, items, args.device, **kw, cached=cached)
                    if (which == "bare" or analysis not in CACHED) and not m.get("forward_cpu_s"):
                        raise RuntimeError(f"{which}: no forward was timed (Attention.reduce / layer_maps not called)")
                    if which not in best or m["cpu_s"] < best[which]["cpu_s"]:
                        best[which] = m
            ops = {}
            if args.ops:  # one more run of each under the profiler (untimed): what each dispatches per 1,000 pieces
                for which in ("bare", analysis):
                    run = (functools.partial(run_bare, enc, encoded, args.device, **kw) if which == "bare" else
                           functools.partial(run_analysis, analysis, enc, items, args.device, **kw, cached=cached))
                    with device_steps() if args.device_steps else contextlib.nullcontext():
                        counted = dispatched(run, args.device)
                    ops[which] = {f"{k}_per_1000_pieces": round(v / pieces * 1000, 1) for k, v in counted.items()}
                if analysis in CACHED:  # the scoring alone was run: the analysis is the extraction's maps + it
                    ops["scoring"] = ops.pop(analysis)
                    ops[analysis] = {k: round(v + ops["scoring"].get(k, 0.0), 1) for k, v in ops["bare"].items()}
            bare, mine = best["bare"], best[analysis]
            # host work outside the forward, each run's own (no forward's variation between runs in it)
            direct = host_outside_forward(mine) - (0.0 if analysis in CACHED else host_outside_forward(bare))
            if analysis in CACHED:  # the scoring alone was timed: the analysis is the extraction's maps + it
                mine = dict(mine, seconds=bare["seconds"] + mine["seconds"], cpu_s=bare["cpu_s"] + mine["cpu_s"],
                            scoring_seconds=mine["seconds"], scoring_cpu_s=mine["cpu_s"])
            row = dict(inputs=len(items), sentences=n_sentences, pieces=pieces, **(dict(cache=built) if built else {}),
                       bare=dict(bare, tokens_per_s=round(pieces / bare["seconds"])),
                       analysis=dict(mine, tokens_per_s=round(pieces / mine["seconds"])),
                       throughput_ratio=round(bare["seconds"] / mine["seconds"], 3),
                       cpu_ratio=round(bare["cpu_s"] / mine["cpu_s"], 3),
                       extra_cpu_s_per_1000=round((mine["cpu_s"] - bare["cpu_s"]) / n_sentences * 1000, 3),
                       reductions_cpu_s_per_1000=round(mine.get("reductions_cpu_s", 0.0) / n_sentences * 1000, 3),
                       host_cpu_s_per_1000=round((mine["cpu_s"] - bare["cpu_s"] - mine.get("reductions_cpu_s", 0.0))
                                                 / n_sentences * 1000, 3),
                       host_outside_forward_cpu_s_per_1000=round(direct / n_sentences * 1000, 3),
                       # bare's CPU over bare's plus the analysis's own costs, each read off its own run (its
                       # reductions and its host work outside the forwards): the throughput without the forward's
                       # variation between the two runs
                       own_costs_ratio=round(bare["cpu_s"] / (bare["cpu_s"] + mine.get("reductions_cpu_s", 0.0)
                                                              + direct), 3))
            if ops:
                row["dispatched"] = ops
            results["analyses"][analysis] = row
            print(f"{analysis}: {len(items)} inputs ({n_sentences} sentences, {pieces} pieces); bare "
                  f"{row['bare']['tokens_per_s']} tok/s ({bare['cpu_s']:.2f} CPU-s, anon peak "
                  f"{bare['anon_peak_mib']} MiB); {analysis} {row['analysis']['tokens_per_s']} tok/s "
                  f"({mine['cpu_s']:.2f} CPU-s, anon peak {mine['anon_peak_mib']} MiB): throughput "
                  f"{row['throughput_ratio']:.1%} of bare (CPU {row['cpu_ratio']:.1%}; bare's forward with the "
                  f"analysis's own costs {row['own_costs_ratio']:.1%}), "
                  f"{row['extra_cpu_s_per_1000']:+} CPU-s per 1,000 sentences: reductions' tensor operators "
                  f"{row['reductions_cpu_s_per_1000']}, host work {row['host_cpu_s_per_1000']:+} (outside the "
                  f"forwards, each run's own: {row['host_outside_forward_cpu_s_per_1000']:+})" + (f"; GPU peak {mine.get('gpu_peak_gib')} GiB"
                                                      if args.device == "cuda" else ""), flush=True)
            if ops:
                steps = " with a device's steps" if args.device_steps else ""
                print(f"{analysis}: dispatched per 1,000 pieces{steps} (one more run each, untimed): "
                      + "; ".join(f"{which} " + ", ".join(f"{v:g} {k.removesuffix('_per_1000_pieces')}"
                                                          for k, v in counted.items())
                                  for which, counted in ops.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
