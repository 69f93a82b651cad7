# The two commands of the README. Each runs the idempotent set-up first.
PY := .venv/bin/python

.PHONY: setup demo test workflows bench
setup:
	bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

# The suite on ComfyUI 0.3.75, then on 0.33.0 when a 0.33 tree is provided (see scripts/test.sh).
test:
	bash scripts/test.sh

workflows: setup
	$(PY) scripts/build_example_workflows.py
