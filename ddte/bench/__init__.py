"""The benchmarks: decoding methods side by side in the loop, and verifiers on synthetic trees."""
