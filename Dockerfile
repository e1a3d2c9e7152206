# devd in a container: the daemon is PID 1, handles SIGTERM itself (no --init needed), keeps its state in the
# /var/lib/devd volume and serves JSON-RPC on TCP port 7411 to clients that present the token.
#
#   docker build -t devd .
#   docker run -d --name devd -v devd-state:/var/lib/devd -p 127.0.0.1:7411:7411 devd
#   docker exec devd cat /var/lib/devd/token          # the token, created 0600 on first start
#   devd status --connect tcp://127.0.0.1:7411 --token-file ./token
#
# A named volume takes the image's /var/lib/devd (owner devd, uid 10001, mode 0700); a bind-mounted host directory
# must be given that owner and mode (`chown 10001:10001 DIR && chmod 700 DIR`), or the daemon refuses to start.
# `docker stop` waits 10 s before SIGKILL; the daemon lets calls in flight finish for up to 10 s and calls default
# to 5 s, so the default is enough; raise it with `--stop-timeout` if you raise `--call-timeout`.

# -- build: the wheel, with the wasm core built by the hatchling hook using the pinned ziglang build requirement --
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# Only what the wheel is built from; .gitignore too, since hatchling leaves out what it names (caches, bytecode).
COPY pyproject.toml hatch_build.py README.md .gitignore ./
COPY devd/ devd/
COPY core/ core/
RUN pip wheel --no-deps -w /wheels .

# -- runtime: the wheel and its dependencies, nothing else --------------------------------------------------------
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install /wheels/devd-*.whl
# The daemon refuses a state directory others can write; both are made 0700 and its own.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/devd --no-create-home --shell /usr/sbin/nologin devd \
 && install -d -m 0700 -o devd -g devd /var/lib/devd /run/devd
USER 10001:10001
WORKDIR /var/lib/devd
VOLUME /var/lib/devd
EXPOSE 7411
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["devd", "status", "--connect", "tcp://127.0.0.1:7411", "--token-file", "/var/lib/devd/token", "--json"]
CMD ["devd", "serve", "--state-dir", "/var/lib/devd", "--socket", "/run/devd/devd.sock", "--listen", "tcp://0.0.0.0:7411", "--log-format", "json"]
