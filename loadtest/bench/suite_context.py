"""What the suite's sections share, apart from the suite's own runner (so section modules such as
fp8_sections.py and spec_device.py import this, and the suite imports them, without a circle):
the report every section adds rows to, the measured ceilings, and random-weight engines."""
from __future__ import annotations


class Report:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []
        self.data: dict = {}

    def add(self, section: str, what: str, value, note: str = "") -> None:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        self.rows.append((section, what, text + (f"  ({note})" if note else "")))
        self.data.setdefault(section, {})[what] = value
        print(f"[{section}] {what}: {text}" + (f"  ({note})" if note else ""), flush=True)

    def table(self) -> str:
        w0 = max((len(r[0]) for r in self.rows), default=8)
        w1 = max((len(r[1]) for r in self.rows), default=8)
        return "\n".join(f"{s:<{w0}}  {k:<{w1}}  {v}" for s, k, v in self.rows)


def measure_ceilings(ctx) -> None:
    """The `ceilings` section: copy bandwidth, bf16 and FP8 matmul peaks of ctx's device."""
    from .shapes import measure_ceilings as measure

    c = measure(ctx["dev"])
    ctx["ceilings"] = c
    ctx["report"].add("ceilings", "copy_GB_s", c.copy_gb_s, "read+write, 1 GiB bf16 copy")
    ctx["report"].add("ceilings", "bf16_matmul_TFLOPs", c.matmul_tflops, "8192^3, random data")
    ctx["report"].add("ceilings", "fp8_matmul_TFLOPs", c.fp8_matmul_tflops,
                      "torch._scaled_mm e4m3 8192^3, per-tensor scales, bf16 out")


def need_ceilings(ctx):
    if ctx["ceilings"] is None:
        measure_ceilings(ctx)
    return ctx["ceilings"]


def random_engine(ctx, name, **kw):
    """An engine of the named shape (loadtest/bench/shapes.py) with random weights drawn on the device."""
    from .gpu_engine import make_engine
    from .shapes import config_only_dir

    return make_engine(config_only_dir(name, ctx["root"]), load_format="dummy", **kw)
