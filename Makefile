# The two commands of the README. Each runs the idempotent set-up first.
PY := .venv/bin/python

.PHONY: setup demo test workflows bench
setup:
	bash scripts/setup.sh

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest -c tests/pytest.ini tests

workflows: setup
	$(PY) scripts/build_example_workflows.py
