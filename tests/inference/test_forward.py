"""The model forward of query prefill and decoding (``inference/model/forward.py``) against
transformers' own forward (the oracle): the same tokens at the same positions after the same
context give the same next-token logits and the same greedy answer.

Tolerances: float32 (the tiny random Qwen2 / Llama-3 / Qwen3 models): the static step runs the
model's own modules over a preallocated buffer, so its prefill does transformers' arithmetic
(measured: identical logits) and its decode steps differ only by the single-query attention
being two float32 matmuls instead of SDPA: max |Δlogit| <= LOGIT_ATOL_FP32. bfloat16 (SmolLM2,
the served default): the first-token logits are transformers' bit for bit (the prefill runs
the same kernels), and the greedy tokens are equal.

The compiled forward (``torch.compile``, inductor) is held to the eager one in the heavy tier
(compiling takes tens of seconds per shape on one CPU thread): same greedy tokens, first-token
logits within LOGIT_ATOL_COMPILED_FP32 (inductor fuses and reorders the float32 arithmetic),
and a compilation that breaks the graph or falls back to eager fails the test.
"""

from __future__ import annotations

import pytest
import torch
from kv_oracle import cached_logits, greedy_after, max_abs, prefix_kv
from store_fixtures import TINY_ARCHITECTURES, random_ids, tiny_model

from coinrag.inference.model.encode import from_cache, to_dynamic_cache
from coinrag.inference.model.forward import (
    CompiledForward,
    StaticForward,
    TransformersForward,
    capacity_bucket,
    forward_for,
    make_forward,
    query_bucket,
    resolve_forward,
    static_unsupported,
    use_forward,
)
from coinrag.inference.model.generate import prefill_and_decode
from coinrag.inference.model.graphs import GraphForward, StepGraph
from coinrag.schemas.settings import ApiSettings, RuntimeSettings, SettingsError

LOGIT_ATOL_FP32 = 1e-4
LOGIT_ATOL_COMPILED_FP32 = 1e-4
N_TOKENS = 12


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def tiny(request):
    return tiny_model(request.param, seed=3)


@pytest.fixture(scope="module")
def smollm2():
    from coinrag.inference.model.loading import load_model

    return load_model(None, dtype="bfloat16")


class _NoEos:
    """A tokenizer stand-in: no EOS, token ids as text (the tiny models' vocabulary)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _oracle(model, context_ids, query, n=N_TOKENS):
    """transformers' own forward: first-token logits and ``n`` greedy tokens of ``query``
    after the KV of ``context_ids``."""
    ctx = prefix_kv(model, context_ids)
    first = cached_logits(model, ctx, query)
    cache = to_dynamic_cache(ctx, model.config)
    with torch.inference_mode():
        model(
            input_ids=torch.tensor([query]),
            position_ids=torch.arange(len(context_ids), len(context_ids) + len(query))[None],
            past_key_values=cache,
            use_cache=True,
        )
    tokens = greedy_after(model, cache, first, len(context_ids) + len(query), n)
    return ctx, first, tokens


def _generate(model, tokenizer, ctx, query, n=N_TOKENS):
    model.generation_config.eos_token_id = None
    return prefill_and_decode(
        model, tokenizer, ctx, ctx.shape[-2], query, max_new_tokens=n, keep_first_logits=True
    )


def test_static_forward_equals_transformers_on_tiny_models(tiny) -> None:
    model = tiny
    assert static_unsupported(model) is None
    assert isinstance(use_forward(model, "eager"), StaticForward)
    context, query = random_ids(30, 1), random_ids(7, 2)
    ctx, first, tokens = _oracle(model, context, query)
    gen = _generate(model, _NoEos(), ctx, query)
    assert max_abs(gen.first_logits, first) <= LOGIT_ATOL_FP32
    assert gen.token_ids == tokens


def test_static_forward_equals_transformers_on_smollm2(smollm2) -> None:
    model, tok = smollm2.model, smollm2.tokenizer
    assert isinstance(use_forward(model, "eager"), StaticForward)
    context = tok("The Eiffel Tower is in Paris. It was built in 1889 by Gustave Eiffel.")
    query = tok(" Question: where is the Eiffel Tower? Answer:")["input_ids"]
    ctx, first, tokens = _oracle(model, context["input_ids"], query, n=8)
    gen = _generate(model, tok, ctx, query, n=8)
    assert torch.equal(gen.first_logits, first)  # the prefill runs transformers' kernels
    until_eos = tokens[: tokens.index(tok.eos_token_id)] if tok.eos_token_id in tokens else tokens
    assert gen.token_ids == until_eos


def test_prefill_computes_the_last_positions_logits_only(tiny) -> None:
    """The LM head sees one position per forward (a 7-token query prefill included)."""
    model = tiny
    rows: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    try:
        ctx = prefix_kv(model, random_ids(10, 4))
        for forward in (StaticForward(model), TransformersForward(model)):
            rows.clear()
            run = forward.begin(ctx, 10, 7, 2)
            with torch.inference_mode():
                run.prefill(random_ids(7, 5))
                run.step(9)
            assert rows == [1, 1], type(forward).__name__
    finally:
        hook.remove()


def test_decode_writes_into_the_preallocated_buffer(tiny) -> None:
    """The context is written once into a buffer of a bucket's length; each token's keys
    and values land in place at its position (no buffer is reallocated or concatenated), and
    they are the keys and values transformers' own forward caches."""
    model = tiny
    forward = StaticForward(model)
    context, query = random_ids(20, 6), random_ids(5, 7)
    ctx = prefix_kv(model, context)
    run = forward.begin(ctx, 20, 5, 4)
    tensors = list(run.buffer.tensors)
    pointers = [t.data_ptr() for t in tensors]
    assert run.buffer.capacity == capacity_bucket(29) == 256
    with torch.inference_mode():
        run.prefill(query)
        run.step(11)
        run.step(12)
    assert [t.data_ptr() for t in run.buffer.tensors] == pointers
    assert all(a is b for a, b in zip(run.buffer.tensors, tensors, strict=True))
    want = prefix_kv(model, context + query + [11, 12])  # (layers, 2, H, 27, D)
    for layer in range(want.shape[0]):
        for kv in (0, 1):
            got = run.buffer.tensors[2 * layer + kv][0, :, :27]
            assert max_abs(got, want[layer, kv]) <= 1e-5


def test_one_sequence_at_a_time_per_buffer(tiny) -> None:
    forward = StaticForward(tiny)
    first = forward.begin(None, 0, 3, 2)
    with torch.inference_mode():
        first.prefill(random_ids(3, 8))
        forward.begin(None, 0, 3, 2)  # the same bucket: takes the buffer
        with pytest.raises(RuntimeError, match="another sequence took this model's KV buffer"):
            first.step(4)


def test_a_cache_of_other_positions_continues_with_transformers_own_call(tiny) -> None:
    """Keys that are not one per position ``0..n-1`` (KVLink's gaps filled after the context)
    cannot sit in the buffer at their positions: that run is transformers' call."""
    run = StaticForward(tiny).begin(prefix_kv(tiny, random_ids(10, 9)), 12, 0, 2)
    assert type(run).__name__ == "_TransformersRun" and run.position == 12


def test_seq_len_dependent_rope_runs_transformers_own_call() -> None:
    model = tiny_model(
        "llama3", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    )
    assert "depends on the forward's length" in static_unsupported(model)
    assert isinstance(make_forward(model, "compiled"), TransformersForward)
    assert isinstance(forward_for(model), TransformersForward)


def test_buckets() -> None:
    assert [query_bucket(n) for n in (1, 2, 16, 17, 25, 64, 65)] == [1, 16, 16, 32, 32, 64, 128]
    assert [capacity_bucket(n) for n in (1, 256, 257, 2100)] == [256, 256, 512, 4096]


def test_the_forward_setting() -> None:
    assert RuntimeSettings().forward == ApiSettings().forward == "auto"
    with pytest.raises(SettingsError, match="forward must be one of auto, eager, compiled, graphs"):
        RuntimeSettings(forward="fast")
    with pytest.raises(SettingsError, match="got 'fast'"):
        ApiSettings(forward="fast").validate()
    assert resolve_forward("auto", serving=False, device="cuda") == "eager"  # one-shot query
    assert resolve_forward("auto", serving=True, device="cuda") == "graphs"
    assert resolve_forward("auto", serving=True, device="mps") == "compiled"
    assert resolve_forward("auto", serving=True, device="cpu") == "eager"  # RESULTS.md
    assert resolve_forward("compiled", serving=False) == "compiled"
    assert RuntimeSettings(forward="graphs").forward == "graphs"
    with pytest.raises(ValueError, match="forward 'fast' is not one of eager, compiled, graphs"):
        make_forward(tiny_model("qwen2"), "fast")


# ---------------------------------------------------------------------------- graphs


def test_step_graph_static_inputs() -> None:
    """One int64 tensor holds a step's ids (padded with the last), positions and last index;
    the step reads views of it, so a captured graph sees each new question's inputs."""
    seen = []
    graph = StepGraph(4, "cpu", lambda ids, positions, last: seen.append((ids, positions, last)))
    address = graph.inputs.data_ptr()
    graph.load([7, 8], 30)
    assert graph.inputs.tolist() == [7, 8, 8, 8, 30, 31, 32, 33, 1]
    graph.run()
    ids, positions, last = seen[-1]
    assert ids.tolist() == [[7, 8, 8, 8]] and positions.tolist() == [30, 31, 32, 33]
    assert last.tolist() == [1] and ids.data_ptr() == address
    graph.load([5], 40)
    assert graph.inputs.tolist() == [5, 5, 5, 5, 40, 41, 42, 43, 0]
    assert graph.inputs.data_ptr() == address and graph.replays == 0 and graph.graph is None
    with pytest.raises(ValueError, match="5 ids do not fit a step of 4"):
        graph.load([1, 2, 3, 4, 5], 0)


def test_graphs_forward_equals_eager_on_cpu(tiny) -> None:
    """Without CUDA the graphs forward runs its bucketed whole-buffer step eagerly over the
    static inputs: the greedy tokens of transformers' forward and of the eager one, first
    logits within LOGIT_ATOL_FP32; one StepGraph per (query bucket, capacity), reused."""
    model = tiny
    context, query = random_ids(30, 1), random_ids(7, 2)
    ctx, first, tokens = _oracle(model, context, query)
    use_forward(model, "eager")
    eager = _generate(model, _NoEos(), ctx, query)
    forward = use_forward(model, "graphs")
    assert isinstance(forward, GraphForward) and forward.warms_served_shapes
    got = _generate(model, _NoEos(), ctx, query)
    assert set(forward.graphs) == {(16, 256), (1, 256)}
    steps = {key: (g, g.inputs.data_ptr()) for key, g in forward.graphs.items()}
    assert got.token_ids == eager.token_ids == tokens
    assert max_abs(got.first_logits, eager.first_logits) <= LOGIT_ATOL_FP32
    assert max_abs(got.first_logits, first) <= LOGIT_ATOL_FP32
    again = _generate(model, _NoEos(), ctx, query)
    assert again.token_ids == tokens
    assert {k: (g, g.inputs.data_ptr()) for k, g in forward.graphs.items()} == steps
    assert all(g.graph is None and g.replays == 0 for g in forward.graphs.values())
    use_forward(model, "eager")


# ---------------------------------------------------------------------------- compiled


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.heavy
def test_compiled_forward_equals_eager_on_tiny_models(tiny) -> None:
    """Greedy tokens equal, first-token logits within LOGIT_ATOL_COMPILED_FP32; the prefill
    and the decode step each ran a compiled graph (fullgraph: a graph break raises)."""
    from torch._dynamo.utils import counters

    model = tiny
    context, query = random_ids(30, 1), random_ids(7, 2)
    ctx, first, tokens = _oracle(model, context, query)
    eager = _generate(model, _NoEos(), ctx, query)
    compiled = use_forward(model, "compiled")
    assert isinstance(compiled, CompiledForward)
    before = _graphs()
    got = _generate(model, _NoEos(), ctx, query)
    assert _graphs() - before == 2  # the 16-token prefill bucket and the decode step
    assert compiled.shapes == {(16, 256), (1, 256)}
    assert not counters["graph_break"]
    assert got.token_ids == eager.token_ids == tokens
    assert max_abs(got.first_logits, eager.first_logits) <= LOGIT_ATOL_COMPILED_FP32
    again = _generate(model, _NoEos(), ctx, query)  # the same shapes: no new graph
    assert _graphs() - before == 2 and again.token_ids == tokens
    use_forward(model, "eager")


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["eager", "compiled", "graphs"])
def test_forward_on_cuda_equals_transformers(kind: str) -> None:
    """On a GPU (tests/benchmarks/gpu_check.sh): the static, compiled and graphs forwards of a tiny
    float32 Qwen2 give the greedy tokens and first-token logits of transformers' own call on
    the same device (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model("qwen2", seed=3).to("cuda")
    context, query = random_ids(30, 1), random_ids(7, 2)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([context], device="cuda"), use_cache=True)
        ctx = from_cache(out.past_key_values)
        oracle = TransformersForward(model).begin(ctx, 30, 7, N_TOKENS)
        first = oracle.prefill(query)
        tokens, nxt = [], int(first.argmax())
        for _ in range(N_TOKENS):
            tokens.append(nxt)
            nxt = int(oracle.step(nxt).argmax())
    use_forward(model, kind)
    gen = _generate(model, _NoEos(), ctx, query)
    assert gen.first_logits.device.type == "cuda"
    assert max_abs(gen.first_logits, first) <= LOGIT_ATOL_FP32
    assert gen.token_ids == tokens


@pytest.mark.cuda
def test_graphs_on_cuda_replay_and_equal_eager() -> None:
    """The graphs forward on a GPU: the prefill and the decode step each captured once and
    replayed (the second question replays both, captures nothing), the answers equal to the
    eager forward's on the same device (tokens equal, first logits within LOGIT_ATOL_FP32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model("qwen2", seed=3).to("cuda")
    context, query = random_ids(30, 1), random_ids(7, 2)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([context], device="cuda"), use_cache=True)
        ctx = from_cache(out.past_key_values)
    use_forward(model, "eager")
    eager = _generate(model, _NoEos(), ctx, query)
    forward = use_forward(model, "graphs")
    got = _generate(model, _NoEos(), ctx, query)
    graphs = forward.graphs
    assert set(graphs) == {(16, 256), (1, 256)}
    assert all(g.graph is not None and not g.failed for g in graphs.values())
    assert graphs[(1, 256)].replays == N_TOKENS - 1 and graphs[(16, 256)].replays == 1
    again = _generate(model, _NoEos(), ctx, query)
    assert set(forward.graphs) == {(16, 256), (1, 256)}
    assert graphs[(16, 256)].replays == 2
    assert got.token_ids == again.token_ids == eager.token_ids
    assert max_abs(got.first_logits, eager.first_logits) <= LOGIT_ATOL_FP32
    assert torch.equal(got.first_logits, again.first_logits)
