"""The course's own code, off the engine's path: lesson 01's loop without a cache and its backend (no_cache,
naive), lesson 02's contiguous cache and static-batch loop (contiguous, generate), lesson 03's count of the
tokens each forward carries (counting), lesson 05's record of each step (step_records), lesson 06's float8
e4m3 rounding by hand (fp8). The lessons and the checks use them as references and oracles; the engine never
imports them."""
