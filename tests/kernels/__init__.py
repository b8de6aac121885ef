"""kernels tests (tests/README.md says what each folder holds)."""
