"""k8s tests (tests/README.md says what each folder holds)."""
