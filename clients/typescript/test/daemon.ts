/**
 * The real daemon for the tests: `python -m devd serve` on a socket and state directory of its own, in a temporary
 * directory, with the flags and environment a test gives it (a fleet's `--store`, `DEVD_FAILPOINTS`). The Python is
 * `$DEVD_PYTHON`, else the repository's `.venv/bin/python` (what `make setup` makes).
 */

import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

/** The repository's root, from dist/test/ (where this file runs, compiled). */
export const ROOT = fileURLToPath(new URL("../../../../", import.meta.url));
const PYTHON = process.env.DEVD_PYTHON ?? join(ROOT, ".venv", "bin", "python");
const START_TIMEOUT_MS = 20_000; // a cold start compiles the core: well under a second here, generous for a loaded CI
const STOP_TIMEOUT_MS = 15_000;

export interface DaemonOptions {
  /** Listen on TCP too. */
  tcp?: boolean;
  /** Flags after `serve`'s own (a fleet's `--store URL --node NAME`, say). */
  args?: string[];
  /** Variables over this process's environment; `DEVD_FAILPOINTS` brings `DEVD_TESTING=1`, as tests/daemon.py's. */
  env?: Record<string, string>;
}

/** How the daemon's process ended: its exit status, or the signal that ended it. */
export interface Exit {
  code: number | null;
  signal: NodeJS.Signals | null;
}

export class Daemon {
  readonly socket: string;
  readonly state: string;
  /** `tcp://127.0.0.1:PORT` when it listens on TCP too. */
  readonly tcp: string | undefined;
  readonly log: string[] = [];
  /** The environment of the next `launch` (set it to {} to start again without failpoints). */
  env: Record<string, string>;
  private child: ChildProcess | null = null;
  private exited: Promise<Exit> = Promise.resolve({ code: null, signal: null });

  private constructor(
    readonly root: string,
    port: number | undefined,
    readonly args: readonly string[],
    env: Record<string, string>,
  ) {
    this.env = env;
    this.socket = join(root, "run", "devd.sock");
    this.state = join(root, "state");
    this.tcp = port === undefined ? undefined : `tcp://127.0.0.1:${port}`;
  }

  /** A daemon that accepts on its Unix socket (and on TCP, with `tcp: true`). */
  static async start(options: DaemonOptions = {}): Promise<Daemon> {
    const root = mkdtempSync(join(tmpdir(), "devd-ts-")); // 0700, as the daemon requires of its directories
    const port = options.tcp === true ? await freePort() : undefined;
    const daemon = new Daemon(root, port, options.args ?? [], options.env ?? {});
    await daemon.launch();
    return daemon;
  }

  /** Start the daemon again on the same socket and state directory (after `stop`). */
  async launch(): Promise<void> {
    const args = ["-m", "devd", "serve", "--socket", this.socket, "--state-dir", this.state, "--log-format", "json"];
    if (this.tcp !== undefined) args.push("--listen", this.tcp);
    args.push(...this.args);
    const env: NodeJS.ProcessEnv = { ...process.env, PYTHONPATH: ROOT, ...this.env };
    for (const name of ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET", "WATCHDOG_USEC"]) {
      delete env[name]; // this daemon binds its own sockets, whatever started the tests
    }
    if ("DEVD_FAILPOINTS" in this.env) env.DEVD_TESTING = "1"; // a daemon obeys failpoints only in a test
    const readyBefore = this.readyLines();
    const child = spawn(PYTHON, args, { cwd: ROOT, env, stdio: ["ignore", "ignore", "pipe"] });
    this.child = child;
    this.exited = new Promise((resolve) => child.once("exit", (code, signal) => resolve({ code, signal })));
    child.stderr?.on("data", (data: Buffer) => this.log.push(data.toString()));
    await this.waitReady(child, readyBefore);
  }

  /** The TCP token, once the daemon has written it in its state directory. */
  async token(): Promise<string> {
    const path = join(this.state, "token");
    const deadline = Date.now() + START_TIMEOUT_MS;
    for (;;) {
      const token = existsSync(path) ? readFileSync(path, "utf8").trim() : "";
      if (token !== "") return token;
      if (Date.now() > deadline) throw new Error(`the daemon wrote no token in ${this.state}`);
      await sleep(20);
    }
  }

  /** SIGTERM, then the exit status (the daemon exits 0 after a graceful shutdown). */
  async stop(): Promise<number | null> {
    const child = this.child;
    if (child === null) return null;
    child.kill("SIGTERM");
    const timer = setTimeout(() => child.kill("SIGKILL"), STOP_TIMEOUT_MS);
    const { code } = await this.exited;
    clearTimeout(timer);
    this.child = null;
    return code;
  }

  /** Wait for the running daemon to end by itself (a failpoint's kill, say); how it ended. */
  async exit(): Promise<Exit> {
    const exit = await this.exited;
    this.child = null;
    return exit;
  }

  /** Stop, and delete the directory: the end of a test file. */
  async remove(): Promise<number | null> {
    const code = await this.stop();
    rmSync(this.root, { recursive: true, force: true });
    return code;
  }

  /**
   * Wait for this start's `daemon.ready` log line, as tests/daemon.py does: a socket that accepts is not enough (in a
   * fleet, the daemon reads the store's sessions after it binds, and a test that went on then saw a later step).
   */
  private async waitReady(child: ChildProcess, readyBefore: number): Promise<void> {
    const deadline = Date.now() + START_TIMEOUT_MS;
    for (;;) {
      if (child.exitCode !== null) throw new Error(`the daemon exited with ${child.exitCode}:\n${this.log.join("")}`);
      if (this.readyLines() > readyBefore) return;
      if (Date.now() > deadline) throw new Error(`the daemon was not ready within ${START_TIMEOUT_MS} ms`);
      await sleep(20);
    }
  }

  private readyLines(): number {
    return this.log.join("").split('"daemon.ready"').length - 1;
  }
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      const port = typeof address === "object" && address !== null ? address.port : 0;
      server.close(() => resolve(port));
    });
  });
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
