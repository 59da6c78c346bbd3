"""Built-in environments: arithmetic, countdown, math/gsm8k, code, and the sandbox that runs model code."""
