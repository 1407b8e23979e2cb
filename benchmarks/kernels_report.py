"""The tables benchmarks/attention_kernels.py prints from its rows (one dict per measurement)."""

from __future__ import annotations


def print_env(env: dict) -> None:
    print(f"\n{env['gpu']} ({env['sms']} SMs), torch {env['torch']}, triton {env['triton']}")


def print_decode(rows: list[dict]) -> None:
    print(
        f"{'decode':<16}{'B':>5}{'ctx':>7}{'us':>9}{'TB/s':>7}{'SDPA':>7}{'ratio':>7}"
        f"{'vs anchor':>10}{'eager':>7}{'eag-nv':>7}{'relerr':>9}"
    )
    for r in rows:
        if r["kind"] == "decode":
            print(
                f"{r['variant']:<16}{r['batch']:>5}{r['ctx']:>7}{r['ms'] * 1e3:>9.1f}"
                f"{r['TBps']:>7.2f}{r['sdpa_TBps']:>7.2f}{r['ratio']:>7.2f}"
                f"{r['anchor_ratio']:>10.2f}{r['eager_TBps']:>7.2f}"
                f"{r['eager_novalidate_TBps']:>7.2f}{r['rel_err']:>9.1e}"
            )


def print_decode_wide(rows: list[dict]) -> None:
    """Decode through a CUDA graph's full-width block table, default split count."""
    wide = [r for r in rows if r["kind"] == "decode_wide"]
    if not wide:
        return
    print(
        f"{'decode, wide table':<20}{'B':>5}{'ctx':>7}{'table':>7}{'us':>9}{'TB/s':>7}{'relerr':>9}"
    )
    for r in wide:
        print(
            f"{'default':<20}{r['batch']:>5}{r['ctx']:>7}{r['table_tokens']:>7}"
            f"{r['ms'] * 1e3:>9.1f}{r['TBps']:>7.2f}{r['rel_err']:>9.1e}"
        )


def print_prefill(rows: list[dict]) -> None:
    print(
        f"{'prefill':<18}{'L':>6}{'us':>9}{'TFLOP/s':>9}{'SDPA':>7}{'ratio':>7}"
        f"{'vs anchor':>10}{'relerr':>9}"
    )
    for r in rows:
        if r["kind"] == "prefill" and "error" not in r:
            print(
                f"{r['variant']:<18}{r['L']:>6}{r['ms'] * 1e3:>9.1f}{r['TFLOPs']:>9.0f}"
                f"{r['sdpa_TFLOPs']:>7.0f}{r['ratio']:>7.2f}{r['anchor_ratio']:>10.2f}"
                f"{r['rel_err']:>9.1e}"
            )
        elif r["kind"] == "prefill":
            print(f"{r['variant']:<18}{r['L']:>6}  failed: {r['error']}")


def print_prefill_mix(rows: list[dict]) -> None:
    """One prompt step of W's mix: our kernel once against SDPA once per prompt."""
    mix = [r for r in rows if r["kind"] == "prefill_mix"]
    if not mix:
        return
    ok = [r for r in mix if "error" not in r]
    head = f"prefill mix ({ok[0]['prompts']} prompts)" if ok else "prefill mix"
    print(f"{head:<26}{'tokens':>7}{'us':>9}{'TFLOP/s':>9}{'SDPA':>7}{'ratio':>7}{'relerr':>9}")
    for r in mix:
        if "error" in r:
            print(f"{r['variant']:<26}{r['L']:>7}  failed: {r['error']}")
            continue
        print(
            f"{r['variant']:<26}{r['L']:>7}{r['ms'] * 1e3:>9.1f}{r['TFLOPs']:>9.0f}"
            f"{r['sdpa_TFLOPs']:>7.0f}{r['ratio']:>7.2f}{r['rel_err']:>9.1e}"
        )


def print_split_sweep(rows: list[dict], shapes, splits) -> None:
    """The ``--sweep splits`` table (nothing when the sweep did not run)."""
    sweep = [r for r in rows if r["kind"] == "splits"]
    if sweep:
        print("decode TB/s by explicit num_splits (default tiling)")
        print(f"{'B':>5}{'ctx':>7}" + "".join(f"{s:>6}" for s in splits))
        for batch, ctx in shapes:
            tb = [r["TBps"] for r in sweep if (r["batch"], r["ctx"]) == (batch, ctx)]
            print(f"{batch:>5}{ctx:>7}" + "".join(f"{t:>6.2f}" for t in tb))
