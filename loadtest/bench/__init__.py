"""Engine and kernel benchmarks (GPU suite `duet bench`, CPU engine, Triton kernels).

The load generator itself lives one level up (`loadtest/`); these measure the engine and
its kernels directly, on random-weight models of real shapes. Results: NOTES in
GPU_NOTES.md here, CPU figures in ../CPU_NOTES.md, kernel figures in kernels/NOTES.md."""


def main(argv=None):
    """`duet bench` (kept light: the suite imports torch)."""
    from .suite import main as suite_main
    return suite_main(argv)
