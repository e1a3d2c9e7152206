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
#
# The agent: profiles in /etc/devd/agents.toml (CONFIGURATION_DIRECTORY, below), API keys in the environment,
# workspaces under /workspaces (owner devd), with workspace_roots = ["/workspaces"] in the profile:
#   docker run -d --name devd -v devd-state:/var/lib/devd -v ./agents.toml:/etc/devd/agents.toml:ro \
#     -v devd-work:/workspaces -e OPENAI_API_KEY -p 127.0.0.1:7411:7411 \
#     --security-opt seccomp=unconfined --security-opt apparmor=unconfined --security-opt systempaths=unconfined devd
# Exec and Git run under bubblewrap, installed here, which makes user, mount and pid namespaces and mounts a fresh
# /proc: Docker's default seccomp profile refuses unshare() and mount() to a process without CAP_SYS_ADMIN, its
# AppArmor profile refuses mount(), and its masks over parts of /proc make the kernel refuse a fresh /proc. The three
# --security-opt lift exactly those for this container (its processes still hold no capability: devd runs as uid
# 10001); `--privileged` lifts them too, with much more besides. Without them the daemon runs, Read and Write work,
# and Exec and Git are refused, saying why (docs/operations.md, "The agent in a container").

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
    PYTHONUNBUFFERED=1 \
    CONFIGURATION_DIRECTORY=/etc/devd
# bubblewrap, the sandbox of Exec and Git; git, the Git tool. The distribution's current versions (security updates
# arrive under new version numbers, so a pin would stop the build).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap git \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install /wheels/devd-*.whl
# The daemon refuses a state directory others can write; both are made 0700 and its own. Workspaces are its own too
# (a command runs as the daemon's user and writes there); /etc/devd holds the profiles, read-only to it.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/devd --no-create-home --shell /usr/sbin/nologin devd \
 && install -d -m 0700 -o devd -g devd /var/lib/devd /run/devd \
 && install -d -m 0755 -o devd -g devd /workspaces \
 && install -d -m 0755 /etc/devd
USER 10001:10001
WORKDIR /var/lib/devd
VOLUME /var/lib/devd /workspaces
EXPOSE 7411
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["devd", "status", "--connect", "tcp://127.0.0.1:7411", "--token-file", "/var/lib/devd/token", "--json"]
CMD ["devd", "serve", "--state-dir", "/var/lib/devd", "--socket", "/run/devd/devd.sock", "--listen", "tcp://0.0.0.0:7411", "--log-format", "json"]
