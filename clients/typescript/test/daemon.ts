/**
 * The real daemon for the tests: `python -m devd serve` on a socket and state directory of its own, in a temporary
 * directory. The Python is `$DEVD_PYTHON`, else the repository's `.venv/bin/python` (what `make setup` makes).
 */

import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createConnection, createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

/** The repository's root, from dist/test/ (where this file runs, compiled). */
const ROOT = fileURLToPath(new URL("../../../../", import.meta.url));
const PYTHON = process.env.DEVD_PYTHON ?? join(ROOT, ".venv", "bin", "python");
const START_TIMEOUT_MS = 20_000; // a cold start compiles the core: well under a second here, generous for a loaded CI
const STOP_TIMEOUT_MS = 15_000;

export class Daemon {
  readonly socket: string;
  readonly state: string;
  /** `tcp://127.0.0.1:PORT` when it listens on TCP too. */
  readonly tcp: string | undefined;
  readonly log: string[] = [];
  private child: ChildProcess | null = null;
  private exited: Promise<number | null> = Promise.resolve(null);

  private constructor(
    readonly root: string,
    port: number | undefined,
  ) {
    this.socket = join(root, "run", "devd.sock");
    this.state = join(root, "state");
    this.tcp = port === undefined ? undefined : `tcp://127.0.0.1:${port}`;
  }

  /** A daemon that accepts on its Unix socket (and on TCP, with `tcp: true`). */
  static async start(options: { tcp?: boolean } = {}): Promise<Daemon> {
    const root = mkdtempSync(join(tmpdir(), "devd-ts-")); // 0700, as the daemon requires of its directories
    const daemon = new Daemon(root, options.tcp === true ? await freePort() : undefined);
    await daemon.launch();
    return daemon;
  }

  /** Start the daemon again on the same socket and state directory (after `stop`). */
  async launch(): Promise<void> {
    const args = ["-m", "devd", "serve", "--socket", this.socket, "--state-dir", this.state, "--log-format", "json"];
    if (this.tcp !== undefined) args.push("--listen", this.tcp);
    const env: NodeJS.ProcessEnv = { ...process.env, PYTHONPATH: ROOT };
    for (const name of ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET", "WATCHDOG_USEC"]) {
      delete env[name]; // this daemon binds its own sockets, whatever started the tests
    }
    const child = spawn(PYTHON, args, { cwd: ROOT, env, stdio: ["ignore", "ignore", "pipe"] });
    this.child = child;
    this.exited = new Promise((resolve) => child.once("exit", (code) => resolve(code)));
    child.stderr?.on("data", (data: Buffer) => this.log.push(data.toString()));
    await this.waitConnectable(child);
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
    const code = await this.exited;
    clearTimeout(timer);
    this.child = null;
    return code;
  }

  /** Stop, and delete the directory: the end of a test file. */
  async remove(): Promise<number | null> {
    const code = await this.stop();
    rmSync(this.root, { recursive: true, force: true });
    return code;
  }

  private async waitConnectable(child: ChildProcess): Promise<void> {
    const deadline = Date.now() + START_TIMEOUT_MS;
    for (;;) {
      if (child.exitCode !== null) throw new Error(`the daemon exited with ${child.exitCode}:\n${this.log.join("")}`);
      if (await accepts(this.socket)) return;
      if (Date.now() > deadline) throw new Error(`the daemon did not accept within ${START_TIMEOUT_MS} ms`);
      await sleep(20);
    }
  }
}

function accepts(path: string): Promise<boolean> {
  return new Promise((resolve) => {
    const probe = createConnection({ path });
    probe.once("connect", () => {
      probe.end();
      resolve(true);
    });
    probe.once("error", () => resolve(false));
  });
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
