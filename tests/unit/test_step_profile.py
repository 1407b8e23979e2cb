"""The step profile a node records with SPLITSERVE_STEP_PROFILE (engine.step_profile): the real
engine behind AsyncEngine, as a node runs it; the rows and table written when it stops."""

import asyncio
import json

from splitserve.engine.loop import AsyncEngine
from splitserve.engine.step_profile import PHASES
from splitserve.models.sampling_params import SamplingParams
from splitserve.models.tiny import write_random_checkpoint
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.node import build_engine


def test_an_engine_thread_profiles_its_steps_and_writes_them_when_stopped(tmp_path):
    model = write_random_checkpoint(tmp_path / "model", with_tokenizer=False)
    config = NodeConfig(
        model_path=str(model), kv_cache_mb=16, kv_transfer="none", max_num_batched_tokens=32
    )
    engine, _ = build_engine(config, prefill_only=False)
    path = tmp_path / "profile.json"
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def scenario() -> None:
        loop_engine = AsyncEngine(engine, str(path))
        loop_engine.start()
        try:
            queues = [loop_engine.subscribe(f"r{i}") for i in range(3)]
            for i in range(3):  # 3 prompts of 40 tokens: 4 chunked-prefill steps, then decodes
                await loop_engine.call(engine.add_request, f"r{i}", [7 + i] * 40, params)
            for queue in queues:
                while (await asyncio.wait_for(queue.get(), 30)).finish_reason is None:
                    pass
        finally:
            await loop_engine.stop()
        assert path.exists()
        return loop_engine.steps, loop_engine.step_seconds

    steps, step_seconds = asyncio.run(scenario())
    profile = json.loads(path.read_text())
    rows = profile["rows"]
    assert len(rows) == steps > 4  # a row per forward the engine thread counted
    # The rows' walls lie inside the engine thread's own timing of the same steps.
    assert 0 < sum(r["wall"] for r in rows) <= step_seconds
    assert {r["prefill"] for r in rows} == {True, False}
    starts = [r["start"] for r in rows]
    assert starts == sorted(starts) and starts[0] >= 0
    for row in rows:
        assert 1 <= row["seqs"] <= 3
        # Every timed phase lies inside the step (``other``, the rest, is what is left).
        assert row["wall"] > 0 and all(row[p] >= 0 for p in PHASES)
    table = {line["steps"]: line for line in profile["table"]}
    assert table["prefill"]["count"] == sum(r["prefill"] for r in rows)
    assert table["prefill"]["count"] >= 4  # 120 prompt tokens at 32 a step
    assert max(r["seqs"] for r in rows if not r["prefill"]) == 3  # the three decode together
    assert 1 <= table["decode"]["seqs"] <= 3
