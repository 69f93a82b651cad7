# The two commands of the README. Each runs the idempotent set-up first.
#   make demo                         ComfyUI 0.33.0 when a 0.33 tree is found (COMFYUI_033_PATH, a tree
#                                     set-up unpacked before, COMFYUI_033_TARBALL or ../shared/comfyui),
#                                     else ComfyUI 0.3.75 (the Tiled VAE row's photograph needs TAEF2: 0.33)
#   make demo COMFYUI_VERSION=0.3.75  ComfyUI 0.3.75 (or your own tree: COMFYUI_PATH=...)
#   make test                         the suite on 0.3.75, then on 0.33.0 when a 0.33 tree is provided
FOUND_033 := $(or $(COMFYUI_033_PATH),$(wildcard .cache/comfyui-0.33.0/main.py),$(wildcard $(or $(COMFYUI_033_TARBALL),../shared/comfyui/comfyui-0.33.0.tar.gz)))
COMFYUI_VERSION ?= $(if $(FOUND_033),0.33,0.3.75)
ifeq ($(COMFYUI_VERSION),0.33)
PY := $(or $(MEMORYKIT_VENV_033),.venv-0.33)/bin/python
DEMO_ENV := COMFYUI_PATH=$(or $(COMFYUI_033_PATH),$(CURDIR)/.cache/comfyui-0.33.0)
else
PY := $(or $(MEMORYKIT_VENV),.venv)/bin/python
DEMO_ENV :=
endif

.PHONY: setup demo test workflows
setup:
	bash scripts/setup.sh $(COMFYUI_VERSION)

demo: setup
	$(DEMO_ENV) $(PY) scripts/demo.py

test:
	bash scripts/test.sh

workflows: setup
	$(DEMO_ENV) $(PY) scripts/build_example_workflows.py
