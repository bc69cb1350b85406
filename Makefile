# The two commands of the README. Both create .venv and install everything first.
.PHONY: setup demo test test-fast
setup:
	@bash scripts/setup.sh

demo: setup
	OMP_NUM_THREADS=1 .venv/bin/autopar train gpt2-tiny --nproc 2 --dp 2 --steps 30 --lr 3e-3 --parity

test: setup
	.venv/bin/python -m pytest -q -ra --durations=40 -n 2 --dist load

test-fast: setup
	.venv/bin/python -m pytest -q -ra -m "not slow" -n 2 --dist load
