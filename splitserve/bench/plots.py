"""PNG plots of a run (matplotlib, Agg backend: no display needed; ``pip install
splitserve[bench]``): latency CDFs, throughput and concurrency over time, the servers' KV usage
over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from splitserve.bench.metrics import RequestRecord, occupancy

__all__ = ["INSTALL_HINT", "require_matplotlib", "write_plots"]

INSTALL_HINT = "--plots needs matplotlib: pip install splitserve[bench]"


def require_matplotlib() -> None:
    """Raise ImportError saying what to install, before a run whose plots could not be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: Sequence[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not values:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = sorted(v * 1000 for v in values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post")
    ax.set_ylim(0, 1.02)


def latency_cdfs(plt, records: Sequence[RequestRecord], path: Path) -> None:
    done = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    _cdf(axes[0][0], [r.ttft for r in done if r.ttft is not None], "time to first token")
    _cdf(axes[0][1], [r.tpot for r in done if r.tpot is not None], "time per output token")
    _cdf(axes[1][0], [x for r in done for x in r.itl], "inter-token latency")
    _cdf(axes[1][1], [r.e2e for r in done if r.e2e is not None], "end-to-end latency")
    fig.suptitle(f"latency CDFs ({len(done)} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def throughput(plt, timeline: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    t = timeline["t_s"]
    ax.step(t, timeline["output_tokens_per_s"], where="pre", label="output tok/s")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.step(t, timeline["requests_per_s"], where="pre", color="tab:orange", label="requests/s")
    ax2.set_ylabel("completed requests/s")
    ax2.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower left", fontsize="small")
    ax.set_title("throughput over time (per bin)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def concurrency(plt, records: Sequence[RequestRecord], scraped: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    for label, pairs in (
        ("in flight (client)", [(r.start, r.end) for r in records]),
        ("queued (client)", [(r.arrival, r.start) for r in records]),
    ):
        ax.step(*occupancy(pairs), where="post", label=label)
    for name, points in sorted(scraped.get("queue_length", {}).items()):
        ax.plot([t for t, _ in points], [v for _, v in points], "--", label=f"queue {name}")
    ax.set_xlabel("s since start")
    ax.set_ylabel("requests")
    ax.set_title("requests in flight and queued")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def kv_usage(plt, scraped: dict, path: Path) -> None:
    families = [f for f in ("kv_usage", "kv_slot_utilization") if scraped.get(f)]
    fig, axes = plt.subplots(len(families), 1, figsize=(9, 3.5 * len(families)), squeeze=False)
    for ax, family in zip(axes[:, 0], families, strict=True):
        for name, points in sorted(scraped[family].items()):
            ax.plot([t for t, _ in points], [v for _, v in points], marker=".", label=name)
        ax.set_title(family.replace("_", " ") + " (scraped)")
        ax.set_xlabel("s since start")
        ax.set_ylabel("share (0..1)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_plots(
    folder: str | Path, records: Sequence[RequestRecord], timeline: dict, scraped: dict
) -> list[str]:
    """Write the PNGs into ``folder`` (made if missing); their paths. ``kv_usage.png`` only when
    some KV gauge was scraped (``--metrics-url``)."""
    plt = _pyplot()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "latency_cdf.png", out / "throughput.png", out / "concurrency.png"]
    latency_cdfs(plt, records, paths[0])
    throughput(plt, timeline, paths[1])
    concurrency(plt, records, scraped, paths[2])
    if scraped.get("kv_usage") or scraped.get("kv_slot_utilization"):
        paths.append(out / "kv_usage.png")
        kv_usage(plt, scraped, paths[-1])
    return [str(p) for p in paths]
