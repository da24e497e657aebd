"""One table of ``memoryBudget`` examples that the operator's parser and the CRD must agree on.

``tests/operator/test_operator_quantity.py`` holds ``graphkeeper.proto.policy.parse_quantity``
to it; ``tests/cluster/test_crd.py`` holds the CRD's CEL rules to it on a real kube-apiserver.
The rule: a whole number of bytes (a quantity whose value is an integer, however it is
written: 1.5Gi is 1,610,612,736 bytes), from 0 to 2^63-1, with a decimal or binary suffix; no
``m`` suffix (1000m is a typo for a byte budget), no sign, no exponent, at most 10 digits after
the point before a binary suffix.
"""

from __future__ import annotations

#: Admitted values and the bytes they mean.
ACCEPTED: list[tuple[int | str, int]] = [
    (0, 0), (4096, 4096), ("1024", 1024), ("0", 0),
    ("256Mi", 256 * 2**20), ("1.5Gi", 1_610_612_736), ("2.5Gi", 5 * 2**29),
    ("1.5Mi", 3 * 2**19), ("0.5Ki", 512), ("7Ei", 7 * 2**60), ("1.25Ki", 1280),
    ("0.0009765625Ki", 1),  # ten digits after the point: exactly one byte
    ("2G", 2 * 10**9), ("1.5G", 1_500_000_000), ("1.001k", 1001), ("1.000k", 1000),
    ("3.0", 3), ("8.000000000000001E", 8_000_000_000_000_001_000),
    ("9007199254740993", 9_007_199_254_740_993), ("9223372036854775807", 2**63 - 1),
    (2**63 - 1, 2**63 - 1), ("09223372036854775807", 2**63 - 1),
    ("9223372036854775807.00", 2**63 - 1), ("7.99999999999999999E", 7_999_999_999_999_999_990),
    ("9223372036854775806", 2**63 - 2),
    # Every other spelling of 2^63-1 (the API server's quantity() caps larger values at it, so
    # the CRD tells it apart by its spelling; each suffix, zeros before and after).
    ("9223372036854775.807k", 2**63 - 1), ("9223372036854.775807M", 2**63 - 1),
    ("9223372036.854775807G", 2**63 - 1), ("9223372.036854775807T", 2**63 - 1),
    ("9223.372036854775807P", 2**63 - 1), ("9.223372036854775807E", 2**63 - 1),
    ("9.2233720368547758070E", 2**63 - 1), ("09.223372036854775807E", 2**63 - 1),
    ("9223.3720368547758070000P", 2**63 - 1), ("9007199254740991.9990234375Ki", 2**63 - 1),
]

#: Refused values.
REFUSED: list[int | float | str] = [
    "1000m", "100m", "0.5", "1.5", 0.5, "0.0001k", "1.0001k", "1.1Gi", "0.1Ki",
    "0.00097656250Ki",  # one whole byte, but eleven digits after the point
    "1e9", "1E3", "-1", -1, "+1", "lots", "", "1.5K", "1.5gi", " 1Gi", "1Gi ",
    "8Ei", "16Ei", "9223372036854775808", "9223372036854775807.5", 2**63, "10E", "1..5Gi",
    ".5Gi", "9.223372036854775808E", "9223.372036854775808P", "9007199254740992Ki",
    "9223372036854775.808k",
]
