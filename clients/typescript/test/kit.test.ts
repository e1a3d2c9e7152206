/** What the client does on its own: the default address, and following MOVED as devd.client follows it. */

import assert from "node:assert/strict";
import { mkdtempSync } from "node:fs";
import { createServer, type Server } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { connect, DevdError, defaultAddress } from "../src/client.js";
import { Daemon } from "./daemon.js";

let daemon: Daemon;

before(async () => {
  daemon = await Daemon.start();
});

after(async () => {
  assert.equal(await daemon.remove(), 0, daemon.log.join(""));
});

test("the default address is $DEVD_SOCKET when it is set", () => {
  assert.equal(defaultAddress({ DEVD_SOCKET: "/x/d.sock", XDG_RUNTIME_DIR: "/run/user/7" }), "/x/d.sock");
});

test("the default address is the daemon's own default socket otherwise, as devd.config says", () => {
  const uid = process.getuid?.() ?? 0;
  assert.deepEqual(
    [
      defaultAddress({ RUNTIME_DIRECTORY: "/run/devd:/run/other", XDG_RUNTIME_DIR: "/run/user/7" }),
      defaultAddress({ XDG_RUNTIME_DIR: "/run/user/7" }),
      defaultAddress({ DEVD_SOCKET: "" }),
    ],
    ["/run/devd/devd.sock", "/run/user/7/devd/devd.sock", `/tmp/devd-${uid}/devd.sock`],
  );
});

interface Request {
  id: number;
  method: string;
  params: Record<string, unknown>;
}

const HELLO = {
  server: { name: "devd", version: "0.1.0" },
  protocol: 1,
  abi: 1,
  limits: {
    line_bytes_max: 16777216,
    sessions_max: 1000000,
    connections_max: 1024,
    call_timeout_ms: 5000,
    memory_bytes_per_session: 67108864,
    keys_kept_per_session: 1000,
  },
};

/**
 * A stand-in daemon on a Unix socket of its own: it answers `initialize` as devd does, and every other call with
 * MOVED naming `owner` (or, with no owner, `{"session": "s"}`). It keeps what it was sent.
 */
async function standIn(owner: string | null): Promise<{ path: string; server: Server; seen: Request[] }> {
  const path = join(mkdtempSync(join(tmpdir(), "devd-moved-")), "d.sock");
  const seen: Request[] = [];
  const server = createServer((socket) => {
    let buffered = "";
    socket.on("data", (data) => {
      buffered += data.toString();
      for (let end = buffered.indexOf("\n"); end >= 0; end = buffered.indexOf("\n")) {
        const request = JSON.parse(buffered.slice(0, end)) as Request;
        buffered = buffered.slice(end + 1);
        seen.push(request);
        const owned = { node: "b", address: owner };
        const moved = { code: -32013, message: "session 's' lives elsewhere", data: { kind: "MOVED", owner: owned } };
        const answer =
          request.method === "initialize"
            ? { result: HELLO }
            : owner === null
              ? { result: { session: "s" } }
              : { error: moved };
        socket.write(JSON.stringify({ jsonrpc: "2.0", id: request.id, ...answer }) + "\n");
      }
    });
  });
  await new Promise<void>((resolve) => server.listen(path, resolve));
  return { path, server, seen };
}

test("a MOVED naming another Unix socket of this machine is followed there", async () => {
  const a = await standIn(`unix:${daemon.socket}`);
  const client = await connect(a.path);
  try {
    assert.deepEqual(
      [await client.call("session/new", { session: "followed" }), client.address],
      [{ session: "followed" }, `unix:${daemon.socket}`],
    );
  } finally {
    await client.close();
    a.server.close();
  }
});

test("the token is not given to a daemon a MOVED names that the client was not given", async () => {
  const b = await standIn(null);
  const a = await standIn(b.path);
  const client = await connect(a.path, { token: "t".repeat(32) });
  try {
    await client.call("session/new", { session: "s" });
    assert.deepEqual(
      b.seen.map((r) => [r.method, r.params.token]),
      [
        ["initialize", undefined],
        ["session/new", undefined],
      ],
    );
  } finally {
    await client.close();
    a.server.close();
    b.server.close();
  }
});

test("a MOVED naming a TCP address the client was not given is not followed, and says so", async () => {
  const a = await standIn("tcp://192.0.2.1:7411");
  const client = await connect(a.path);
  try {
    const error = await client.call("session/new", { session: "s" }).catch((e: unknown) => e);
    assert.ok(error instanceof DevdError);
    assert.deepEqual(
      [error.kind, error.message.includes("not followed: tcp://192.0.2.1:7411 is not an address this client")],
      ["MOVED", true],
    );
  } finally {
    await client.close();
    a.server.close();
  }
});

test("a MOVED to a peer that is not there leaves the client where it was, and is thrown", async () => {
  const a = await standIn(`tcp://127.0.0.1:1`); // no one listens: the owner is gone, and the MOVED is thrown as is
  const client = await connect(a.path, { peers: ["tcp://127.0.0.1:1"] });
  try {
    const error = await client.call("session/new", { session: "s" }).catch((e: unknown) => e);
    assert.deepEqual([error instanceof DevdError && error.kind, client.address], ["MOVED", a.path]);
  } finally {
    await client.close();
    a.server.close();
  }
});

test("connect without an address reaches the daemon at the default address", async () => {
  const saved = process.env.DEVD_SOCKET;
  process.env.DEVD_SOCKET = daemon.socket;
  try {
    const client = await connect();
    await client.close();
    assert.equal(client.address, daemon.socket);
  } finally {
    if (saved === undefined) delete process.env.DEVD_SOCKET;
    else process.env.DEVD_SOCKET = saved;
  }
});
