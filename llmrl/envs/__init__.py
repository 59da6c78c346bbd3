"""Built-in environments: arithmetic, countdown, math/gsm8k, code, reasoning-gym's tasks, and the sandbox that
runs model code."""
