"""The ranges the contract's scalar types carry (duet.proto): int32 fields, the uint64 seed
(a negative seed down to -2**63 travels as its two's complement), float fields as float32.
Pure constants, part of the contract: the gateway's request checks and the wire module's
refusals (shared/wire/contract_overflow.py) both read them, so what passes the edge always
fits the wire."""

INT32_MAX = (1 << 31) - 1
INT32_MIN = -(1 << 31)
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1
FLOAT32_MAX = 3.4028234663852886e38
