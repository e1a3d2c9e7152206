//! Native unit tests of the target-independent logic (`zig build test`).
const std = @import("std");
const msg = @import("messages.zig");
const session = @import("session.zig");
const snapshot = @import("snapshot.zig");

test "paths inside and outside the workspace" {
    for ([_][]const u8{ "src/lib.rs", "./a", "a/..", "a/./b", "", "a//b" }) |p|
        try std.testing.expect(msg.insideWorkspace(p));
    for ([_][]const u8{ "/etc/hosts", "../x", "a/../../x", "../../etc/passwd", "a\x00b", ".." }) |p|
        try std.testing.expect(!msg.insideWorkspace(p));
}

test "u64 parsing is strict" {
    try std.testing.expectEqual(@as(u64, 18446744073709551615), try msg.parseU64("18446744073709551615"));
    for ([_][]const u8{ "18446744073709551616", "-1", "1.0", "1e3", "", "-0" }) |s|
        try std.testing.expectError(error.Malformed, msg.parseU64(s));
}

/// Steps `s` with `event` and checks the exact answer.
fn expectStep(s: *session.Session, event: []const u8, want: []const u8) !void {
    var arena: std.heap.ArenaAllocator = .init(std.testing.allocator);
    defer arena.deinit();
    const ev = try msg.parseEvent(arena.allocator(), event);
    var buf: std.Io.Writer.Allocating = .init(std.testing.allocator);
    defer buf.deinit();
    var a: session.Answer = .init(&buf);
    a.begin();
    s.step(ev, &a);
    a.finish();
    try std.testing.expectEqualStrings(want, buf.written());
}

test "the example session, then a snapshot round trip, without leaks" {
    const gpa = std.testing.allocator;
    var s: session.Session = .init(gpa, .{});
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"fix the build\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"messages\":[{\"User\":\"fix the build\"}]}}}]");
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"text\":\"Let me look.\",\"calls\":[{\"Exec\":{\"argv\":[\"cargo\",\"build\"]}},{\"Read\":{\"path\":\"src/lib.rs\"}},{\"Read\":{\"path\":\"../x\"}}]}}}", "[{\"id\":2,\"op\":{\"Exec\":{\"argv\":[\"cargo\",\"build\"]}}},{\"id\":3,\"op\":{\"Read\":{\"path\":\"src/lib.rs\"}}}]");
    try expectStep(&s, "{\"Exec\":{\"id\":2,\"text\":\"error\",\"failed\":true}}", "[]");
    try expectStep(&s, "{\"Turn\":{\"id\":2,\"prompt\":\"next\"}}", "[{\"id\":5,\"op\":{\"Save\":true}}]");

    var snap = snapshot.encode(gpa, &s);
    defer snap.deinit();
    var arena: std.heap.ArenaAllocator = .init(gpa);
    defer arena.deinit();
    var r = try snapshot.decode(gpa, arena.allocator(), snap.written());
    defer r.deinit();
    var again = snapshot.encode(gpa, &r);
    defer again.deinit();
    try std.testing.expectEqualSlices(u8, snap.written(), again.written());

    const cancel = "{\"Cancel\":{\"turn\":1}}";
    const want = "[{\"id\":6,\"op\":{\"Save\":true}},{\"id\":7,\"op\":{\"Done\":{\"turn\":1,\"outcome\":{\"Cancelled\":true}}}},{\"id\":8,\"op\":{\"Model\":{\"messages\":[{\"User\":\"fix the build\"},{\"Agent\":{\"text\":\"Let me look.\",\"calls\":[{\"id\":2,\"call\":{\"Exec\":{\"argv\":[\"cargo\",\"build\"]}}},{\"id\":3,\"call\":{\"Read\":{\"path\":\"src/lib.rs\"}}},{\"id\":4,\"call\":{\"Read\":{\"path\":\"../x\"}}}]}},{\"Tool\":{\"id\":2,\"text\":\"error\",\"failed\":true}},{\"Tool\":{\"id\":3,\"text\":\"cancelled\",\"failed\":true}},{\"Tool\":{\"id\":4,\"text\":\"refused: ../x is not inside the workspace\",\"failed\":true}},{\"User\":\"next\"}]}}}]";
    try expectStep(&s, cancel, want);
    try expectStep(&r, cancel, want);
    try expectStep(&r, "{\"Model\":{\"id\":8,\"reply\":{\"text\":\"ok\"}}}", "[{\"id\":9,\"op\":{\"Emit\":\"ok\"}},{\"id\":10,\"op\":{\"Save\":true}},{\"id\":11,\"op\":{\"Done\":{\"turn\":2,\"outcome\":{\"Complete\":true}}}}]");
}

test "strict decoding" {
    var arena: std.heap.ArenaAllocator = .init(std.testing.allocator);
    defer arena.deinit();
    const bad = [_][]const u8{
        "{\"Timer\":false}",                              "{\"Turn\":{\"id\":\"2\",\"prompt\":\"p\"}}",
        "{\"Turn\":{\"id\":2,\"prompt\":\"p\"},\"x\":1}", "{\"Turn\":{\"id\":2,\"id\":2,\"prompt\":\"p\"}}",
        "{}",                                             "{\"Timer\":true} 1",
    };
    for (bad) |b| try std.testing.expectError(error.Malformed, msg.parseEvent(arena.allocator(), b));
}

/// Checks what `s` reports pending (dev_pending's answer).
fn expectPending(s: *const session.Session, want: []const u8) !void {
    var arena: std.heap.ArenaAllocator = .init(std.testing.allocator);
    defer arena.deinit();
    var buf: std.Io.Writer.Allocating = .init(std.testing.allocator);
    defer buf.deinit();
    var a: session.Answer = .init(&buf);
    a.begin();
    s.writePending(arena.allocator(), &a);
    a.finish();
    try std.testing.expectEqualStrings(want, buf.written());
}

/// Encodes `s`, decodes it, and checks the copy reports `want` pending too.
fn expectPendingRestored(s: *const session.Session, want: []const u8) !void {
    const gpa = std.testing.allocator;
    var snap = snapshot.encode(gpa, s);
    defer snap.deinit();
    var arena: std.heap.ArenaAllocator = .init(gpa);
    defer arena.deinit();
    var r = try snapshot.decode(gpa, arena.allocator(), snap.written());
    defer r.deinit();
    try expectPending(&r, want);
}

test "pending is what was dispatched and is still waited for, in its bytes, across a snapshot" {
    var s: session.Session = .init(std.testing.allocator, .{ .model = "zen5" });
    defer s.deinit();
    try expectPending(&s, "[]");

    const ask = "[{\"id\":1,\"op\":{\"Model\":{\"model\":\"zen5\",\"messages\":[{\"User\":\"fix \\\"it\\\" \u{e9}\"}]}}}]";
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"fix \\\"it\\\" \\u00e9\"}}", ask);
    try expectStep(&s, "{\"Turn\":{\"id\":2,\"prompt\":\"next\"}}", "[{\"id\":2,\"op\":{\"Save\":true}}]");
    try expectPending(&s, ask);
    try expectPendingRestored(&s, ask);

    // Escapes in the model's calls come back in the bytes they were dispatched in.
    const calls = "[{\"id\":3,\"op\":{\"Exec\":{\"argv\":[\"echo\",\"a\\nb\",\"\u{e9}\"]}}},{\"id\":5,\"op\":{\"Write\":{\"path\":\"src/\u{e9}.rs\",\"text\":\"\\\"q\\\"\\t\"}}}]";
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Exec\":{\"argv\":[\"echo\",\"a\\nb\",\"\\u00e9\"]}},{\"Read\":{\"path\":\"/etc/passwd\"}},{\"Write\":{\"path\":\"src/\\u00e9.rs\",\"text\":\"\\\"q\\\"\\t\"}}]}}}", calls);
    try expectPending(&s, calls);
    try expectPendingRestored(&s, calls);

    const write = "[{\"id\":5,\"op\":{\"Write\":{\"path\":\"src/\u{e9}.rs\",\"text\":\"\\\"q\\\"\\t\"}}}]";
    try expectStep(&s, "{\"Exec\":{\"id\":3,\"text\":\"a\"}}", "[]");
    try expectPending(&s, write);
    try expectPendingRestored(&s, write);

    // Cancelling the running turn starts the queued one: its ask is what is pending.
    const next = "[{\"id\":8,\"op\":{\"Model\":{\"model\":\"zen5\",\"messages\":[{\"User\":\"fix \\\"it\\\" \u{e9}\"},{\"Agent\":{\"calls\":[{\"id\":3,\"call\":{\"Exec\":{\"argv\":[\"echo\",\"a\\nb\",\"\u{e9}\"]}}},{\"id\":4,\"call\":{\"Read\":{\"path\":\"/etc/passwd\"}}},{\"id\":5,\"call\":{\"Write\":{\"path\":\"src/\u{e9}.rs\",\"text\":\"\\\"q\\\"\\t\"}}}]}},{\"Tool\":{\"id\":3,\"text\":\"a\"}},{\"Tool\":{\"id\":4,\"text\":\"refused: /etc/passwd is not inside the workspace\",\"failed\":true}},{\"Tool\":{\"id\":5,\"text\":\"cancelled\",\"failed\":true}},{\"User\":\"next\"}]}}}]";
    try expectStep(&s, "{\"Cancel\":{\"turn\":1}}", "[{\"id\":6,\"op\":{\"Save\":true}},{\"id\":7,\"op\":{\"Done\":{\"turn\":1,\"outcome\":{\"Cancelled\":true}}}}," ++ next[1..]);
    try expectPending(&s, next);
    try expectStep(&s, "{\"Cancel\":{\"turn\":2}}", "[{\"id\":9,\"op\":{\"Save\":true}},{\"id\":10,\"op\":{\"Done\":{\"turn\":2,\"outcome\":{\"Cancelled\":true}}}}]");
    try expectPending(&s, "[]");
    try expectPendingRestored(&s, "[]");
}

test "a snapshot whose waited-for calls are not the last message's is malformed" {
    const gpa = std.testing.allocator;
    var s: session.Session = .init(gpa, .{});
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"messages\":[{\"User\":\"p\"}]}}}]");
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Read\":{\"path\":\"a\"}},{\"Read\":{\"path\":\"b\"}}]}}}", "[{\"id\":2,\"op\":{\"Read\":{\"path\":\"a\"}}},{\"id\":3,\"op\":{\"Read\":{\"path\":\"b\"}}}]");

    const Damage = enum { family, id, count, last_message };
    for (std.enums.values(Damage)) |damage| {
        var bad = s.clone(gpa);
        defer bad.deinit();
        const slots = &bad.running.?.phase.calls;
        switch (damage) {
            .family => slots.items[1].family = .exec,
            .id => slots.items[1].id = 4,
            .count => gpa.free(slots.pop().?.text),
            .last_message => {
                try bad.transcript.ensureUnusedCapacity(gpa, 1);
                bad.transcript.appendAssumeCapacity(try gpa.dupe(u8, "{\"User\":\"x\"}"));
            },
        }
        if (damage == .id) bad.counter = 4;
        var snap = snapshot.encode(gpa, &bad);
        defer snap.deinit();
        var arena: std.heap.ArenaAllocator = .init(gpa);
        defer arena.deinit();
        try std.testing.expectError(error.Malformed, snapshot.decode(gpa, arena.allocator(), snap.written()));
    }
}

test "the snapshot's CRC-32 is std.hash.Crc32's, at every length and alignment" {
    var bytes: [300]u8 = undefined;
    var prng: std.Random.DefaultPrng = .init(7);
    prng.random().bytes(&bytes);
    for (0..bytes.len) |n| for (0..3) |start| if (start <= n) {
        try std.testing.expectEqual(std.hash.Crc32.hash(bytes[start..n]), snapshot.crc32(bytes[start..n]));
    };
}

/// The transcript from `from` on, as dev_transcript writes it.
fn expectTranscript(s: *const session.Session, from: usize, want: []const u8) !void {
    var buf: std.Io.Writer.Allocating = .init(std.testing.allocator);
    defer buf.deinit();
    s.writeTranscript(from, &buf);
    try std.testing.expectEqualStrings(want, buf.written());
}

test "a delta session asks with what the model was not sent, and where it starts, across a snapshot" {
    const gpa = std.testing.allocator;
    var arena: std.heap.ArenaAllocator = .init(gpa);
    defer arena.deinit();
    var s: session.Session = .init(gpa, try msg.parseConfig(arena.allocator(), "{\"model\":\"m\",\"asks\":\"delta\"}"));
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"model\":\"m\",\"from\":0,\"messages\":[{\"User\":\"p\"}]}}}]");
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Read\":{\"path\":\"a\"}}]}}}", "[{\"id\":2,\"op\":{\"Read\":{\"path\":\"a\"}}}]");
    const ask = "[{\"id\":3,\"op\":{\"Model\":{\"model\":\"m\",\"from\":1,\"messages\":[{\"Agent\":{\"calls\":[{\"id\":2,\"call\":{\"Read\":{\"path\":\"a\"}}}]}},{\"Tool\":{\"id\":2,\"text\":\"x\"}}]}}}]";
    try expectStep(&s, "{\"File\":{\"id\":2,\"text\":\"x\"}}", ask);
    try expectPending(&s, ask);
    try expectPendingRestored(&s, ask);

    var snap = snapshot.encode(gpa, &s);
    defer snap.deinit();
    try std.testing.expectEqual(snapshot.layout_delta, std.mem.readInt(u32, snap.written()[4..8], .little));
    var r = try snapshot.decode(gpa, arena.allocator(), snap.written());
    defer r.deinit();
    for ([_]*session.Session{ &s, &r }) |x| {
        try expectStep(x, "{\"Model\":{\"id\":3,\"reply\":{\"text\":\"done\"}}}", "[{\"id\":4,\"op\":{\"Emit\":\"done\"}},{\"id\":5,\"op\":{\"Save\":true}},{\"id\":6,\"op\":{\"Done\":{\"turn\":1,\"outcome\":{\"Complete\":true}}}}]");
        try expectStep(x, "{\"Turn\":{\"id\":2,\"prompt\":\"q\"}}", "[{\"id\":7,\"op\":{\"Model\":{\"model\":\"m\",\"from\":3,\"messages\":[{\"Agent\":{\"text\":\"done\"}},{\"User\":\"q\"}]}}}]");
        try expectTranscript(x, 3, "[{\"Agent\":{\"text\":\"done\"}},{\"User\":\"q\"}]");
        try expectTranscript(x, 9, "[]");
    }
    try expectTranscript(&s, 0, "[{\"User\":\"p\"},{\"Agent\":{\"calls\":[{\"id\":2,\"call\":{\"Read\":{\"path\":\"a\"}}}]}},{\"Tool\":{\"id\":2,\"text\":\"x\"}},{\"Agent\":{\"text\":\"done\"}},{\"User\":\"q\"}]");
}

test "a default session's snapshot keeps layout 1, and a delta one whose range is impossible is malformed" {
    const gpa = std.testing.allocator;
    var s: session.Session = .init(gpa, .{});
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"messages\":[{\"User\":\"p\"}]}}}]");
    var plain = snapshot.encode(gpa, &s);
    defer plain.deinit();
    try std.testing.expectEqual(snapshot.layout_full, std.mem.readInt(u32, plain.written()[4..8], .little));

    var d: session.Session = .init(gpa, .{ .asks = .delta });
    defer d.deinit();
    try expectStep(&d, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"from\":0,\"messages\":[{\"User\":\"p\"}]}}}]");
    const Damage = enum { from_past_to, to_past_end, added_while_asking };
    for (std.enums.values(Damage)) |damage| {
        var bad = d.clone(gpa);
        defer bad.deinit();
        switch (damage) {
            .from_past_to => bad.sent_from = 2,
            .to_past_end => bad.sent_to = 2,
            .added_while_asking => bad.sent_to = 0,
        }
        var snap = snapshot.encode(gpa, &bad);
        defer snap.deinit();
        var arena: std.heap.ArenaAllocator = .init(gpa);
        defer arena.deinit();
        try std.testing.expectError(error.Malformed, snapshot.decode(gpa, arena.allocator(), snap.written()));
    }

    // While calls are waited for, the model has been sent everything but the message that dispatched them.
    try expectStep(&d, "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Read\":{\"path\":\"a\"}}]}}}", "[{\"id\":2,\"op\":{\"Read\":{\"path\":\"a\"}}}]");
    try expectPendingRestored(&d, "[{\"id\":2,\"op\":{\"Read\":{\"path\":\"a\"}}}]");
    var resent = d.clone(gpa);
    defer resent.deinit();
    resent.sent_to = 0;
    var snap = snapshot.encode(gpa, &resent);
    defer snap.deinit();
    var arena: std.heap.ArenaAllocator = .init(gpa);
    defer arena.deinit();
    try std.testing.expectError(error.Malformed, snapshot.decode(gpa, arena.allocator(), snap.written()));
}

// ---------------------------------------------------------------- the core's allocator

const pages = @import("pages.zig");
const page = pages.page;

test "the core's allocator passes std's allocator tests" {
    pages.native.reset();
    try std.heap.testAllocator(pages.allocator);
    try std.heap.testAllocatorAligned(pages.allocator);
}

test "freed slots are used again, each by its own size" {
    pages.native.reset();
    const gpa = pages.allocator;
    var slots: [2000][]u8 = undefined;
    for (&slots, 0..) |*slot, i| slot.* = try gpa.alloc(u8, 20 + i % 3 * 500);
    for (slots) |slot| gpa.free(slot);
    const end = pages.memoryEnd();
    for (&slots, 0..) |*slot, i| slot.* = try gpa.alloc(u8, 20 + i % 3 * 500);
    for (slots) |slot| gpa.free(slot);
    try std.testing.expectEqual(end, pages.memoryEnd());
}

test "a large allocation takes the pages it needs, not the next power of two" {
    pages.native.reset();
    const start = pages.memoryEnd();
    const a = try pages.allocator.alloc(u8, 64 * page + 1);
    defer pages.allocator.free(a);
    try std.testing.expectEqual(65 * page, pages.memoryEnd() - start);
}

test "a run freed between two free runs merges with both, and holds allocations of other sizes" {
    pages.native.reset();
    const a = try pages.allocator.alloc(u8, 8 * page);
    const b = try pages.allocator.alloc(u8, 8 * page);
    const c = try pages.allocator.alloc(u8, 8 * page);
    const guard = try pages.allocator.alloc(u8, 2 * page);
    defer pages.allocator.free(guard);
    const end = pages.memoryEnd();
    pages.allocator.free(a);
    pages.allocator.free(c);
    pages.allocator.free(b);
    const x = try pages.allocator.alloc(u8, 20 * page);
    defer pages.allocator.free(x);
    const y = try pages.allocator.alloc(u8, 4 * page);
    defer pages.allocator.free(y);
    const at = @intFromPtr(a.ptr);
    try std.testing.expectEqual([3]usize{ end, at, at + 20 * page }, [3]usize{ pages.memoryEnd(), @intFromPtr(x.ptr), @intFromPtr(y.ptr) });
}

test "the allocation at the end of memory grows in place, and a shrink gives its tail back" {
    pages.native.reset();
    const start = pages.memoryEnd();
    var a = try pages.allocator.alloc(u8, 4 * page);
    a = try pages.allocator.realloc(a, 12 * page);
    const grown_at = @intFromPtr(a.ptr);
    a = try pages.allocator.realloc(a, 2 * page);
    const tail = try pages.allocator.alloc(u8, 10 * page);
    defer pages.allocator.free(tail);
    defer pages.allocator.free(a);
    try std.testing.expectEqual([3]usize{ start, start + 2 * page, start + 12 * page }, [3]usize{ grown_at, @intFromPtr(tail.ptr), pages.memoryEnd() });
}

test "random allocations, resizes and frees keep every byte" {
    pages.native.reset();
    const gpa = pages.allocator;
    var prng = std.Random.DefaultPrng.init(20261202);
    const rand = prng.random();
    var live: [24][]u8 = @splat(&.{});
    for (0..3000) |n| {
        const i = rand.uintLessThan(usize, live.len);
        const mark: u8 = @truncate(i *% 31 +% 7);
        try std.testing.expect(std.mem.allEqual(u8, live[i], mark));
        const len = if (rand.boolean()) rand.uintLessThan(usize, 4 * page) else rand.uintLessThan(usize, 40 * page);
        if (live[i].len == 0) {
            live[i] = try gpa.alloc(u8, len + 1);
        } else if (n % 3 == 0) {
            gpa.free(live[i]);
            live[i] = &.{};
            continue;
        } else {
            live[i] = try gpa.realloc(live[i], len + 1);
        }
        @memset(live[i], mark);
    }
    for (live) |b| if (b.len != 0) gpa.free(b);
}

test "an ask that grows a little at every step, with slots taken between, grows memory by as much" {
    // Each step keeps a 20 KB message and writes an ask of everything so far, freed once the host has it: the
    // turn of bench long --big-turn. Slots whose pages came from the end of memory walled in each freed ask.
    pages.native.reset();
    const gpa = pages.allocator;
    var kept: [300][]u8 = undefined;
    for (&kept, 1..) |*message, n| {
        message.* = try gpa.alloc(u8, 20 * 1024);
        const ask = try gpa.alloc(u8, n * 20 * 1024);
        gpa.free(ask);
    }
    defer for (kept) |message| gpa.free(message);
    const slot_pages = (kept.len + 1) / 2; // two 32 KiB slots a page
    const ask_pages = pages.pagesFor(kept.len * 20 * 1024);
    try std.testing.expectEqual((slot_pages + ask_pages) * page, pages.memoryEnd() - @intFromPtr(&pages.native.memory));
}

// ---------------------------------------------------------------- the generic Tool call (ABI 2)

/// The core's answer to `event` is the empty array, and it says it ignored `id`.
fn expectIgnored(s: *session.Session, event: []const u8, id: u64) !void {
    try expectStep(s, event, "[]");
    try std.testing.expectEqual(@as(?u64, id), s.ignored);
}

test "a Tool call round trips exactly: its input byte for byte, its result a Tool message, across a snapshot" {
    var s: session.Session = .init(std.testing.allocator, .{});
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"look it up\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"messages\":[{\"User\":\"look it up\"}]}}}]");

    // The input is kept as the model wrote it: its spaces, its escapes, its numbers' spelling, its key order.
    const input = "{ \"q\" : [1, 2.50e3, \"\\u00e9\\n\"], \"b\":{}, \"a\":null }";
    const call = "{\"Tool\":{\"name\":\"mcp:docs/search.v2-x_y\",\"input\":" ++ input ++ "}}";
    const dispatched = "[{\"id\":2,\"op\":" ++ call ++ "},{\"id\":3,\"op\":{\"Read\":{\"path\":\"a\"}}}]";
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"text\":\"t\",\"calls\":[{\"Tool\":{\"input\":" ++ input ++ ",\"name\":\"mcp:docs/search.v2-x_y\"}},{\"Read\":{\"path\":\"a\"}}]}}}", dispatched);
    try expectPending(&s, dispatched);
    try expectPendingRestored(&s, dispatched);

    try expectStep(&s, "{\"Tool\":{\"id\":2,\"text\":\"found \\\"x\\\"\",\"failed\":false}}", "[]");
    try expectPending(&s, "[{\"id\":3,\"op\":{\"Read\":{\"path\":\"a\"}}}]");
    try expectStep(&s, "{\"File\":{\"id\":3,\"text\":\"A\"}}", "[{\"id\":4,\"op\":{\"Model\":{\"messages\":[{\"User\":\"look it up\"},{\"Agent\":{\"text\":\"t\",\"calls\":[{\"id\":2,\"call\":" ++ call ++ "},{\"id\":3,\"call\":{\"Read\":{\"path\":\"a\"}}}]}},{\"Tool\":{\"id\":2,\"text\":\"found \\\"x\\\"\"}},{\"Tool\":{\"id\":3,\"text\":\"A\"}}]}}}]");

    // A failed Tool result is a failed Tool message, as every family's is.
    try expectStep(&s, "{\"Model\":{\"id\":4,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"n\",\"input\":{}}}]}}}", "[{\"id\":5,\"op\":{\"Tool\":{\"name\":\"n\",\"input\":{}}}}]");
    try expectStep(&s, "{\"Tool\":{\"id\":5,\"text\":\"no\",\"failed\":true}}", "[{\"id\":6,\"op\":{\"Model\":{\"messages\":[{\"User\":\"look it up\"},{\"Agent\":{\"text\":\"t\",\"calls\":[{\"id\":2,\"call\":" ++ call ++ "},{\"id\":3,\"call\":{\"Read\":{\"path\":\"a\"}}}]}},{\"Tool\":{\"id\":2,\"text\":\"found \\\"x\\\"\"}},{\"Tool\":{\"id\":3,\"text\":\"A\"}},{\"Agent\":{\"calls\":[{\"id\":5,\"call\":{\"Tool\":{\"name\":\"n\",\"input\":{}}}}]}},{\"Tool\":{\"id\":5,\"text\":\"no\",\"failed\":true}}]}}}]");

    // The snapshot of a session with Tool calls in its transcript is taken back, checked, as it was.
    var snap = snapshot.encode(std.testing.allocator, &s);
    defer snap.deinit();
    var arena: std.heap.ArenaAllocator = .init(std.testing.allocator);
    defer arena.deinit();
    var r = try snapshot.decode(std.testing.allocator, arena.allocator(), snap.written());
    defer r.deinit();
    try expectTranscript(&r, 4, "[{\"Agent\":{\"calls\":[{\"id\":5,\"call\":{\"Tool\":{\"name\":\"n\",\"input\":{}}}}]}},{\"Tool\":{\"id\":5,\"text\":\"no\",\"failed\":true}}]");
}

test "a result of the wrong family, or for a closed id, changes nothing for a Tool call or beside it" {
    var s: session.Session = .init(std.testing.allocator, .{});
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"messages\":[{\"User\":\"p\"}]}}}]");
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"t\",\"input\":{\"k\":1}}},{\"Exec\":{\"argv\":[\"make\"]}}]}}}", "[{\"id\":2,\"op\":{\"Tool\":{\"name\":\"t\",\"input\":{\"k\":1}}}},{\"id\":3,\"op\":{\"Exec\":{\"argv\":[\"make\"]}}}]");

    // 2 went out as a Tool and 3 as an Exec; 1 is answered; 99 never went out.
    for ([_][]const u8{
        "{\"Exec\":{\"id\":2,\"text\":\"forged\"}}",
        "{\"File\":{\"id\":2,\"text\":\"forged\"}}",
        "{\"Git\":{\"id\":2,\"text\":\"forged\"}}",
        "{\"Browse\":{\"id\":2,\"text\":\"forged\"}}",
        "{\"Tool\":{\"id\":3,\"text\":\"forged\"}}",
        "{\"Tool\":{\"id\":1,\"text\":\"forged\"}}",
        "{\"Tool\":{\"id\":99,\"text\":\"forged\"}}",
    }) |event| {
        var arena: std.heap.ArenaAllocator = .init(std.testing.allocator);
        defer arena.deinit();
        const ev = try msg.parseEvent(arena.allocator(), event);
        try expectIgnored(&s, event, ev.result.out.id);
    }
    try expectPending(&s, "[{\"id\":2,\"op\":{\"Tool\":{\"name\":\"t\",\"input\":{\"k\":1}}}},{\"id\":3,\"op\":{\"Exec\":{\"argv\":[\"make\"]}}}]");

    try expectStep(&s, "{\"Tool\":{\"id\":2,\"text\":\"r\"}}", "[]");
    try expectIgnored(&s, "{\"Tool\":{\"id\":2,\"text\":\"again\"}}", 2);
    try expectStep(&s, "{\"Exec\":{\"id\":3,\"text\":\"made\"}}", "[{\"id\":4,\"op\":{\"Model\":{\"messages\":[{\"User\":\"p\"},{\"Agent\":{\"calls\":[{\"id\":2,\"call\":{\"Tool\":{\"name\":\"t\",\"input\":{\"k\":1}}}},{\"id\":3,\"call\":{\"Exec\":{\"argv\":[\"make\"]}}}]}},{\"Tool\":{\"id\":2,\"text\":\"r\"}},{\"Tool\":{\"id\":3,\"text\":\"made\"}}]}}}]");
    try expectIgnored(&s, "{\"Tool\":{\"id\":2,\"text\":\"late\"}}", 2);
}

test "a malformed Tool call is never dispatched: the model is told why, under its id" {
    var s: session.Session = .init(std.testing.allocator, .{});
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"messages\":[{\"User\":\"p\"}]}}}]");

    const long: []const u8 = &@as([128]u8, @splat('x'));
    const calls = "[{\"Tool\":{\"name\":\"\",\"input\":{}}}," ++
        "{\"Tool\":{\"name\":\"" ++ long ++ "y\",\"input\":{}}}," ++
        "{\"Tool\":{\"name\":\"a b\",\"input\":{}}}," ++
        "{\"Tool\":{\"name\":\"caf\\u00e9\",\"input\":{}}}," ++
        "{\"Tool\":{\"name\":\"q\\\"\",\"input\":{}}}," ++
        "{\"Tool\":{\"name\":\"arr\",\"input\":[1]}}," ++
        "{\"Tool\":{\"name\":\"str\",\"input\":\"{}\"}}," ++
        "{\"Tool\":{\"name\":\"num\",\"input\":1}}," ++
        "{\"Tool\":{\"name\":\"nil\",\"input\":null}}," ++
        "{\"Tool\":{\"name\":\"" ++ long ++ "\",\"input\":{}}}]";
    // Only the last is dispatched: a name of exactly 128 bytes is a name.
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"calls\":" ++ calls ++ "}}}", "[{\"id\":11,\"op\":{\"Tool\":{\"name\":\"" ++ long ++ "\",\"input\":{}}}}]");
    const told = "{\"Tool\":{\"id\":2,\"text\":\"refused: \\\"\\\" is not a tool name (1-128 bytes of A-Z a-z 0-9 _ . : / -)\",\"failed\":true}}," ++
        "{\"Tool\":{\"id\":3,\"text\":\"refused: a tool name is at most 128 bytes, and this one is 129\",\"failed\":true}}," ++
        "{\"Tool\":{\"id\":4,\"text\":\"refused: \\\"a b\\\" is not a tool name (1-128 bytes of A-Z a-z 0-9 _ . : / -)\",\"failed\":true}}," ++
        "{\"Tool\":{\"id\":5,\"text\":\"refused: \\\"caf\u{e9}\\\" is not a tool name (1-128 bytes of A-Z a-z 0-9 _ . : / -)\",\"failed\":true}}," ++
        "{\"Tool\":{\"id\":6,\"text\":\"refused: \\\"q\\\\\\\"\\\" is not a tool name (1-128 bytes of A-Z a-z 0-9 _ . : / -)\",\"failed\":true}}," ++
        "{\"Tool\":{\"id\":7,\"text\":\"refused: the input of arr is not a JSON object\",\"failed\":true}}," ++
        "{\"Tool\":{\"id\":8,\"text\":\"refused: the input of str is not a JSON object\",\"failed\":true}}," ++
        "{\"Tool\":{\"id\":9,\"text\":\"refused: the input of num is not a JSON object\",\"failed\":true}}," ++
        "{\"Tool\":{\"id\":10,\"text\":\"refused: the input of nil is not a JSON object\",\"failed\":true}}," ++
        "{\"Tool\":{\"id\":11,\"text\":\"ok\"}}";
    var arena: std.heap.ArenaAllocator = .init(std.testing.allocator);
    defer arena.deinit();
    var want: std.Io.Writer.Allocating = .init(arena.allocator());
    try want.writer.writeAll("[{\"id\":12,\"op\":{\"Model\":{\"messages\":[{\"User\":\"p\"},{\"Agent\":{\"calls\":[");
    const parsed = try msg.parseEvent(arena.allocator(), "{\"Model\":{\"id\":1,\"reply\":{\"calls\":" ++ calls ++ "}}}");
    for (parsed.model.reply.calls, 2..) |c, id| {
        if (id != 2) try want.writer.writeByte(',');
        try want.writer.print("{{\"id\":{d},\"call\":", .{id});
        try msg.writeCall(&want.writer, c);
        try want.writer.writeByte('}');
    }
    try want.writer.writeAll("]}}," ++ told ++ "]}}}]");
    try expectStep(&s, "{\"Tool\":{\"id\":11,\"text\":\"ok\"}}", want.written());

    // When every call is refused nothing will come back, so the core asks again at once.
    const again = "{\"Model\":{\"id\":12,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"a\",\"input\":[]}}]}}}";
    var step_answer: std.Io.Writer.Allocating = .init(std.testing.allocator);
    defer step_answer.deinit();
    var a: session.Answer = .init(&step_answer);
    a.begin();
    s.step(try msg.parseEvent(arena.allocator(), again), &a);
    a.finish();
    try std.testing.expect(std.mem.endsWith(u8, step_answer.written(), "{\"Agent\":{\"calls\":[{\"id\":13,\"call\":{\"Tool\":{\"name\":\"a\",\"input\":[]}}}]}},{\"Tool\":{\"id\":13,\"text\":\"refused: the input of a is not a JSON object\",\"failed\":true}}]}}}]"));
    try std.testing.expect(std.mem.startsWith(u8, step_answer.written(), "[{\"id\":14,\"op\":{\"Model\":"));
}

test "a Tool call or result of the wrong shape is a malformed event" {
    var arena: std.heap.ArenaAllocator = .init(std.testing.allocator);
    defer arena.deinit();
    const bad = [_][]const u8{
        "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"t\"}}]}}}",
        "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Tool\":{\"input\":{}}}]}}}",
        "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"t\",\"input\":{},\"x\":1}}]}}}",
        "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"t\",\"name\":\"t\",\"input\":{}}}]}}}",
        "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Tool\":{\"name\":1,\"input\":{}}}]}}}",
        "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"t\",\"input\":{\"a\":}}}]}}}",
        "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"t\",\"input\":{\"a\":1,}}}]}}}",
        "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"t\",\"input\":{}},\"Exec\":{\"argv\":[]}}]}}}",
        "{\"Tool\":{\"id\":1}}",
        "{\"Tool\":{\"id\":1,\"text\":\"t\",\"name\":\"n\"}}",
        "{\"Tool\":{\"id\":\"1\",\"text\":\"t\"}}",
    };
    for (bad) |b| try std.testing.expectError(error.Malformed, msg.parseEvent(arena.allocator(), b));
}

// ---------------------------------------------------------------- state an ABI-1 core wrote

/// Bytes from their hex spelling, at compile time.
fn unhex(comptime hex: []const u8) [hex.len / 2]u8 {
    @setEvalBranchQuota(hex.len * 10);
    var out: [hex.len / 2]u8 = undefined;
    _ = std.fmt.hexToBytes(&out, hex) catch unreachable;
    return out;
}

// Written by the ABI-1 core (b69a352's core/): config {"model":"zen5"}; turn 1 "fix the build"; a reply
// of Exec cargo build, Read src/lib.rs and Read ../x (refused); the Exec's failed result; turn 2 "next" queued.
const abi1_calls = unhex("44455644010000007101000001040000007a656e350500000000000000020000000000000001010000000000000001030000000200000000000000000001050000006572726f72030000000000000001010000000000040000000000000001000129000000726566757365643a202e2e2f78206973206e6f7420696e736964652074686520776f726b7370616365010000000200000000000000040000006e65787402000000180000007b2255736572223a2266697820746865206275696c64227db70000007b224167656e74223a7b2274657874223a224c6574206d65206c6f6f6b2e222c2263616c6c73223a5b7b226964223a322c2263616c6c223a7b2245786563223a7b2261726776223a5b22636172676f222c226275696c64225d7d7d7d2c7b226964223a332c2263616c6c223a7b2252656164223a7b2270617468223a227372632f6c69622e7273227d7d7d2c7b226964223a342c2263616c6c223a7b2252656164223a7b2270617468223a222e2e2f78227d7d7d5d7d7d018945b8");
// Written by the ABI-1 core: config {"asks":"delta"}; turn 1 "p"; a reply of Read a; its result "x": the second ask waited for.
const abi1_delta = unhex("4445564402000000aa000000000300000000000000010000000000000001010000000000000000030000000000000000000000030000000c0000007b2255736572223a2270227d3b0000007b224167656e74223a7b2263616c6c73223a5b7b226964223a322c2263616c6c223a7b2252656164223a7b2270617468223a2261227d7d7d5d7d7d1c0000007b22546f6f6c223a7b226964223a322c2274657874223a2278227d7d0100000000000000030000000000000078364e02");

test "snapshots an ABI-1 core wrote restore as they were and continue with the exact actions, Tool calls after" {
    const gpa = std.testing.allocator;
    for ([_][]const u8{ &abi1_calls, &abi1_delta }) |bytes| for ([_]snapshot.Trust{ .checked, .own }) |trust| {
        var arena: std.heap.ArenaAllocator = .init(gpa);
        defer arena.deinit();
        var r = try snapshot.decodeAs(gpa, arena.allocator(), bytes, trust);
        defer r.deinit();
        var again = snapshot.encode(gpa, &r);
        defer again.deinit();
        try std.testing.expectEqualSlices(u8, bytes, again.written());
    };

    var arena: std.heap.ArenaAllocator = .init(gpa);
    defer arena.deinit();
    var s = try snapshot.decode(gpa, arena.allocator(), &abi1_calls);
    defer s.deinit();
    try expectPending(&s, "[{\"id\":3,\"op\":{\"Read\":{\"path\":\"src/lib.rs\"}}}]");
    const told = "{\"User\":\"fix the build\"},{\"Agent\":{\"text\":\"Let me look.\",\"calls\":[{\"id\":2,\"call\":{\"Exec\":{\"argv\":[\"cargo\",\"build\"]}}},{\"id\":3,\"call\":{\"Read\":{\"path\":\"src/lib.rs\"}}},{\"id\":4,\"call\":{\"Read\":{\"path\":\"../x\"}}}]}},{\"Tool\":{\"id\":2,\"text\":\"error\",\"failed\":true}},{\"Tool\":{\"id\":3,\"text\":\"fn f() {}\"}},{\"Tool\":{\"id\":4,\"text\":\"refused: ../x is not inside the workspace\",\"failed\":true}}";
    try expectStep(&s, "{\"File\":{\"id\":3,\"text\":\"fn f() {}\"}}", "[{\"id\":6,\"op\":{\"Model\":{\"model\":\"zen5\",\"messages\":[" ++ told ++ "]}}}]");
    try expectStep(&s, "{\"Model\":{\"id\":6,\"reply\":{\"calls\":[{\"Tool\":{\"name\":\"search\",\"input\":{\"q\":\"x\"}}}]}}}", "[{\"id\":7,\"op\":{\"Tool\":{\"name\":\"search\",\"input\":{\"q\":\"x\"}}}}]");
    try expectStep(&s, "{\"Tool\":{\"id\":7,\"text\":\"none\"}}", "[{\"id\":8,\"op\":{\"Model\":{\"model\":\"zen5\",\"messages\":[" ++ told ++ ",{\"Agent\":{\"calls\":[{\"id\":7,\"call\":{\"Tool\":{\"name\":\"search\",\"input\":{\"q\":\"x\"}}}}]}},{\"Tool\":{\"id\":7,\"text\":\"none\"}}]}}}]");
    try expectStep(&s, "{\"Model\":{\"id\":8,\"reply\":{\"text\":\"ok\"}}}", "[{\"id\":9,\"op\":{\"Emit\":\"ok\"}},{\"id\":10,\"op\":{\"Save\":true}},{\"id\":11,\"op\":{\"Done\":{\"turn\":1,\"outcome\":{\"Complete\":true}}}},{\"id\":12,\"op\":{\"Model\":{\"model\":\"zen5\",\"messages\":[" ++ told ++ ",{\"Agent\":{\"calls\":[{\"id\":7,\"call\":{\"Tool\":{\"name\":\"search\",\"input\":{\"q\":\"x\"}}}}]}},{\"Tool\":{\"id\":7,\"text\":\"none\"}},{\"Agent\":{\"text\":\"ok\"}},{\"User\":\"next\"}]}}}]");

    var d = try snapshot.decode(gpa, arena.allocator(), &abi1_delta);
    defer d.deinit();
    const ask = "[{\"id\":3,\"op\":{\"Model\":{\"from\":1,\"messages\":[{\"Agent\":{\"calls\":[{\"id\":2,\"call\":{\"Read\":{\"path\":\"a\"}}}]}},{\"Tool\":{\"id\":2,\"text\":\"x\"}}]}}}]";
    try expectPending(&d, ask);
    try expectStep(&d, "{\"Model\":{\"id\":3,\"reply\":{\"text\":\"done\"}}}", "[{\"id\":4,\"op\":{\"Emit\":\"done\"}},{\"id\":5,\"op\":{\"Save\":true}},{\"id\":6,\"op\":{\"Done\":{\"turn\":1,\"outcome\":{\"Complete\":true}}}}]");
}

// ---------------------------------------------------------------- the bounded conversation (ABI 2)

/// Steps `s` with `event` unless it refuses it, as dev_step does; whether it refused.
fn refused(s: *session.Session, event: []const u8) !bool {
    var arena: std.heap.ArenaAllocator = .init(std.testing.allocator);
    defer arena.deinit();
    return s.refuses(try msg.parseEvent(arena.allocator(), event));
}

test "a Summary replaces the start of the conversation; a turn waiting on its ask is asked again with what is left" {
    var s: session.Session = .init(std.testing.allocator, .{ .model = "m" });
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"model\":\"m\",\"messages\":[{\"User\":\"p\"}]}}}]");
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"text\":\"a\"}}}", "[{\"id\":2,\"op\":{\"Emit\":\"a\"}},{\"id\":3,\"op\":{\"Save\":true}},{\"id\":4,\"op\":{\"Done\":{\"turn\":1,\"outcome\":{\"Complete\":true}}}}]");
    try expectStep(&s, "{\"Turn\":{\"id\":2,\"prompt\":\"q\"}}", "[{\"id\":5,\"op\":{\"Model\":{\"model\":\"m\",\"messages\":[{\"User\":\"p\"},{\"Agent\":{\"text\":\"a\"}},{\"User\":\"q\"}]}}}]");

    const asked = "[{\"id\":6,\"op\":{\"Model\":{\"model\":\"m\",\"messages\":[{\"Summary\":{\"text\":\"p, then a\",\"replaced\":2}},{\"User\":\"q\"}]}}}]";
    try std.testing.expect(!try refused(&s, "{\"Summary\":{\"upto\":2,\"text\":\"p, then a\"}}"));
    try expectStep(&s, "{\"Summary\":{\"upto\":2,\"text\":\"p, then a\"}}", asked);
    try expectPending(&s, asked);
    try expectPendingRestored(&s, asked);
    try expectTranscript(&s, 0, "[{\"Summary\":{\"text\":\"p, then a\",\"replaced\":2}},{\"User\":\"q\"}]");
    try expectIgnored(&s, "{\"Model\":{\"id\":5,\"reply\":{\"text\":\"late\"}}}", 5);
    try expectStep(&s, "{\"Model\":{\"id\":6,\"reply\":{\"text\":\"b\"}}}", "[{\"id\":7,\"op\":{\"Emit\":\"b\"}},{\"id\":8,\"op\":{\"Save\":true}},{\"id\":9,\"op\":{\"Done\":{\"turn\":2,\"outcome\":{\"Complete\":true}}}}]");

    // A second Summary replaces the first with the rest, and counts every message of the whole conversation it stands for.
    try expectStep(&s, "{\"Summary\":{\"upto\":3,\"text\":\"all of it\"}}", "[]");
    try expectStep(&s, "{\"Turn\":{\"id\":3,\"prompt\":\"r\"}}", "[{\"id\":10,\"op\":{\"Model\":{\"model\":\"m\",\"messages\":[{\"Summary\":{\"text\":\"all of it\",\"replaced\":4}},{\"User\":\"r\"}]}}}]");
}

test "a Summary that would part a call from its result, or keep nothing it replaces, is refused and changes nothing" {
    const gpa = std.testing.allocator;
    var s: session.Session = .init(gpa, .{});
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"messages\":[{\"User\":\"p\"}]}}}]");
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"calls\":[{\"Read\":{\"path\":\"a\"}},{\"Read\":{\"path\":\"b\"}}]}}}", "[{\"id\":2,\"op\":{\"Read\":{\"path\":\"a\"}}},{\"id\":3,\"op\":{\"Read\":{\"path\":\"b\"}}}]");
    // 0 User, 1 Agent (its calls waited for): only the User may go; the Agent message that dispatched them stays.
    try std.testing.expectEqual([4]bool{ true, false, true, true }, [4]bool{
        try refused(&s, "{\"Summary\":{\"upto\":0,\"text\":\"x\"}}"),
        try refused(&s, "{\"Summary\":{\"upto\":1,\"text\":\"x\"}}"),
        try refused(&s, "{\"Summary\":{\"upto\":2,\"text\":\"x\"}}"),
        try refused(&s, "{\"Summary\":{\"upto\":3,\"text\":\"x\"}}"),
    });
    try expectStep(&s, "{\"File\":{\"id\":2,\"text\":\"A\"}}", "[]");
    try expectStep(&s, "{\"File\":{\"id\":3,\"text\":\"B\"}}", "[{\"id\":4,\"op\":{\"Model\":{\"messages\":[{\"User\":\"p\"},{\"Agent\":{\"calls\":[{\"id\":2,\"call\":{\"Read\":{\"path\":\"a\"}}},{\"id\":3,\"call\":{\"Read\":{\"path\":\"b\"}}}]}},{\"Tool\":{\"id\":2,\"text\":\"A\"}},{\"Tool\":{\"id\":3,\"text\":\"B\"}}]}}}]");
    // 2 and 3 are the results of the calls in 1: a cut before either would keep a result without its call.
    var snap = snapshot.encode(gpa, &s);
    defer snap.deinit();
    try std.testing.expectEqual([5]bool{ false, true, true, false, true }, [5]bool{
        try refused(&s, "{\"Summary\":{\"upto\":1,\"text\":\"x\"}}"),
        try refused(&s, "{\"Summary\":{\"upto\":2,\"text\":\"x\"}}"),
        try refused(&s, "{\"Summary\":{\"upto\":3,\"text\":\"x\"}}"),
        try refused(&s, "{\"Summary\":{\"upto\":4,\"text\":\"x\"}}"),
        try refused(&s, "{\"Summary\":{\"upto\":5,\"text\":\"x\"}}"),
    });
    var after = snapshot.encode(gpa, &s);
    defer after.deinit();
    try std.testing.expectEqualSlices(u8, snap.written(), after.written());
    // Everything, calls and results together, may go while the model is asked.
    try expectStep(&s, "{\"Summary\":{\"upto\":4,\"text\":\"read a and b\"}}", "[{\"id\":5,\"op\":{\"Model\":{\"messages\":[{\"Summary\":{\"text\":\"read a and b\",\"replaced\":4}}]}}}]");
}

test "a delta session's next ask after a Summary sends everything again, from 0, across a snapshot" {
    const gpa = std.testing.allocator;
    var s: session.Session = .init(gpa, .{ .asks = .delta });
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"from\":0,\"messages\":[{\"User\":\"p\"}]}}}]");
    try expectStep(&s, "{\"Model\":{\"id\":1,\"reply\":{\"text\":\"t\",\"calls\":[{\"Read\":{\"path\":\"a\"}}]}}}", "[{\"id\":2,\"op\":{\"Read\":{\"path\":\"a\"}}}]");
    try expectStep(&s, "{\"Summary\":{\"upto\":1,\"text\":\"asked p\"}}", "[]");
    var arena: std.heap.ArenaAllocator = .init(gpa);
    defer arena.deinit();
    var snap = snapshot.encode(gpa, &s);
    defer snap.deinit();
    var r = try snapshot.decode(gpa, arena.allocator(), snap.written());
    defer r.deinit();
    for ([_]*session.Session{ &s, &r }) |x| {
        try expectStep(x, "{\"File\":{\"id\":2,\"text\":\"A\"}}", "[{\"id\":3,\"op\":{\"Model\":{\"from\":0,\"messages\":[{\"Summary\":{\"text\":\"asked p\",\"replaced\":1}},{\"Agent\":{\"text\":\"t\",\"calls\":[{\"id\":2,\"call\":{\"Read\":{\"path\":\"a\"}}}]}},{\"Tool\":{\"id\":2,\"text\":\"A\"}}]}}}]");
        try expectStep(x, "{\"Model\":{\"id\":3,\"reply\":{\"text\":\"done\"}}}", "[{\"id\":4,\"op\":{\"Emit\":\"done\"}},{\"id\":5,\"op\":{\"Save\":true}},{\"id\":6,\"op\":{\"Done\":{\"turn\":1,\"outcome\":{\"Complete\":true}}}}]");
        try expectStep(x, "{\"Turn\":{\"id\":2,\"prompt\":\"q\"}}", "[{\"id\":7,\"op\":{\"Model\":{\"from\":3,\"messages\":[{\"Agent\":{\"text\":\"done\"}},{\"User\":\"q\"}]}}}]");
    }
}

test "a snapshot whose Summary is not the first message is malformed" {
    const gpa = std.testing.allocator;
    var s: session.Session = .init(gpa, .{});
    defer s.deinit();
    try expectStep(&s, "{\"Turn\":{\"id\":1,\"prompt\":\"p\"}}", "[{\"id\":1,\"op\":{\"Model\":{\"messages\":[{\"User\":\"p\"}]}}}]");
    try s.transcript.ensureUnusedCapacity(gpa, 1);
    s.transcript.appendAssumeCapacity(try gpa.dupe(u8, "{\"Summary\":{\"text\":\"x\",\"replaced\":1}}"));
    s.running.?.phase = .{ .asking = 1 };
    var snap = snapshot.encode(gpa, &s);
    defer snap.deinit();
    var arena: std.heap.ArenaAllocator = .init(gpa);
    defer arena.deinit();
    try std.testing.expectError(error.Malformed, snapshot.decode(gpa, arena.allocator(), snap.written()));
}

test "with a Summary every ten turns, the asks of a 2,000-turn session stay as large as at its start" {
    const gpa = std.testing.allocator;
    var s: session.Session = .init(gpa, .{});
    defer s.deinit();
    var arena: std.heap.ArenaAllocator = .init(gpa);
    defer arena.deinit();
    var largest = [2]usize{ 0, 0 }; // turns 100-199, turns 1900-1999
    var id: u64 = 0;
    for (1..2001) |turn| {
        _ = arena.reset(.retain_capacity);
        const a = arena.allocator();
        var ask: usize = 0;
        for ([_][]const u8{
            try std.fmt.allocPrint(a, "{{\"Turn\":{{\"id\":{d},\"prompt\":\"turn {d}: read the file\"}}}}", .{ turn, turn }),
            try std.fmt.allocPrint(a, "{{\"Model\":{{\"id\":{d},\"reply\":{{\"calls\":[{{\"Read\":{{\"path\":\"f{d}\"}}}}]}}}}}}", .{ id + 1, turn }),
            try std.fmt.allocPrint(a, "{{\"File\":{{\"id\":{d},\"text\":\"the text of f{d}\"}}}}", .{ id + 2, turn }),
            try std.fmt.allocPrint(a, "{{\"Model\":{{\"id\":{d},\"reply\":{{\"text\":\"read f{d}\"}}}}}}", .{ id + 3, turn }),
        }) |event| {
            var buf: std.Io.Writer.Allocating = .init(gpa);
            defer buf.deinit();
            var answer: session.Answer = .init(&buf);
            answer.begin();
            s.step(try msg.parseEvent(a, event), &answer);
            answer.finish();
            ask = @max(ask, buf.written().len);
        }
        id += 6;
        if (turn % 10 == 0) {
            const event = try std.fmt.allocPrint(a, "{{\"Summary\":{{\"upto\":{d},\"text\":\"turns up to {d}\"}}}}", .{ s.transcript.items.len, turn });
            const ev = try msg.parseEvent(a, event);
            try std.testing.expect(!s.refuses(ev));
            var buf: std.Io.Writer.Allocating = .init(gpa);
            defer buf.deinit();
            var answer: session.Answer = .init(&buf);
            s.step(ev, &answer);
        }
        if (turn >= 100 and turn < 200) largest[0] = @max(largest[0], ask);
        if (turn >= 1900 and turn < 2000) largest[1] = @max(largest[1], ask);
    }
    try std.testing.expect(s.transcript.items.len <= 41);
    // Numbers grow by a digit from turn 1000 on: a few bytes, never another turn's messages.
    try std.testing.expect(largest[1] < largest[0] + 64);
}
