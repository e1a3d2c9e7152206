//! The core's state machine: one conversation, stepped one event at a time.
//!
//! Every string the session keeps is its own copy in `gpa`. The transcript is
//! kept as compact JSON fragments, one per Message, so an ask is the
//! fragments joined. A step never fails: anything malformed was refused by
//! the decoder before the session saw it, and running out of memory traps.
const std = @import("std");
const Allocator = std.mem.Allocator;
const Writer = std.Io.Writer;
const msg = @import("messages.zig");
const oom = msg.oom;

/// One call of the model answer the running turn is waiting on.
pub const Slot = struct {
    id: u64,
    family: msg.Family,
    /// Dispatched and not yet answered. A refused call is never pending.
    pending: bool,
    failed: bool,
    /// The result (or the refusal); empty while pending.
    text: []u8,
};

pub const Phase = union(enum) {
    /// Waiting for the answer to the ask with this id.
    asking: u64,
    /// Waiting for the results of these calls, in id order.
    calls: std.ArrayList(Slot),
};

pub const Running = struct { turn: u64, phase: Phase };

pub const Queued = struct { turn: u64, prompt: []u8 };

/// The answer of one step: a JSON array of actions being written.
pub const Answer = struct {
    buf: *Writer.Allocating,
    w: *Writer,
    count: usize = 0,
    /// A replay of a step whose answer the host already has: the Model ask,
    /// the one action whose size grows with the session, is not written.
    quiet: bool = false,

    pub fn init(buf: *Writer.Allocating) Answer {
        return .{ .buf = buf, .w = &buf.writer };
    }

    /// Room for n more bytes at once, so a large ask is not built by repeated
    /// growth (which would hold the old and the new buffer together), and no
    /// more: std's growth would take half as much again.
    fn reserve(a: *Answer, n: usize) void {
        a.buf.ensureTotalCapacityPrecise(a.buf.writer.end +| n) catch oom();
    }

    pub fn begin(a: *Answer) void {
        a.w.writeByte('[') catch oom();
    }

    pub fn finish(a: *Answer) void {
        a.w.writeByte(']') catch oom();
    }

    /// Opens `{"id":N,"op":` ; the caller writes the op, then calls `close`.
    fn open(a: *Answer, id: u64) *Writer {
        const w = a.w;
        if (a.count != 0) w.writeByte(',') catch oom();
        a.count += 1;
        w.writeAll("{\"id\":") catch oom();
        msg.writeInt(w, id) catch oom();
        w.writeAll(",\"op\":") catch oom();
        return w;
    }

    fn close(a: *Answer) void {
        a.w.writeByte('}') catch oom();
    }

    fn raw(a: *Answer, id: u64, op: []const u8) void {
        const w = a.open(id);
        w.writeAll(op) catch oom();
        a.close();
    }

    fn emit(a: *Answer, id: u64, text: []const u8) void {
        const w = a.open(id);
        w.writeAll("{\"Emit\":") catch oom();
        msg.writeString(w, text) catch oom();
        w.writeByte('}') catch oom();
        a.close();
    }

    fn save(a: *Answer, id: u64) void {
        a.raw(id, "{\"Save\":true}");
    }

    fn done(a: *Answer, id: u64, turn: u64, complete: bool) void {
        const w = a.open(id);
        w.writeAll("{\"Done\":{\"turn\":") catch oom();
        msg.writeInt(w, turn) catch oom();
        w.writeAll(if (complete) ",\"outcome\":{\"Complete\":true}}}" else ",\"outcome\":{\"Cancelled\":true}}}") catch oom();
        a.close();
    }

    fn call(a: *Answer, id: u64, c: msg.Call) void {
        const w = a.open(id);
        msg.writeCall(w, c) catch oom();
        a.close();
    }
};

/// The Dispatch entries of the transcript's last message, or null when it is
/// not an Agent message. While calls are waited for, that message is the one
/// `dispatch` pushed, with one entry per slot. Strings in the entries point
/// into the transcript or into `arena`.
pub fn dispatched(arena: Allocator, transcript: []const []const u8) ?[]const msg.Dispatch {
    if (transcript.len == 0) return null;
    const m = msg.parseMessage(arena, transcript[transcript.len - 1]) catch return null;
    return switch (m) {
        .agent => |ag| ag.calls,
        else => null,
    };
}

/// Whether the compact JSON Message `f` is of union member `kind`.
pub fn isKind(f: []const u8, comptime kind: []const u8) bool {
    return std.mem.startsWith(u8, f, "{\"" ++ kind ++ "\":");
}

fn writeMessages(w: *Writer, messages: []const []u8) void {
    w.writeByte('[') catch oom();
    for (messages, 0..) |f, i| {
        if (i != 0) w.writeByte(',') catch oom();
        w.writeAll(f) catch oom();
    }
    w.writeByte(']') catch oom();
}

pub const Session = struct {
    gpa: Allocator,
    /// The config's model, named in every ask when present.
    model: ?[]u8 = null,
    /// The last id used; the next action or call is `counter + 1`.
    counter: u64 = 0,
    /// The highest turn id accepted (running, queued, finished or cancelled).
    max_turn: u64 = 0,
    running: ?Running = null,
    /// Turns waiting for the running one to end, oldest first.
    queue: std.ArrayList(Queued) = .empty,
    /// The action id the last step ignored: a Model answer or a result for
    /// an action not dispatched, or already answered. Not part of the state
    /// (a snapshot does not carry it): it describes one step.
    ignored: ?u64 = null,
    /// The conversation, one compact JSON Message per entry.
    transcript: std.ArrayList([]u8) = .empty,
    /// Asks carry only what the model has not been sent (config `asks: delta`).
    delta: bool = false,
    /// With `delta`: the transcript range the last ask carried. While it is
    /// waited for nothing is added, so `sent_to` is the transcript's length.
    sent_from: usize = 0,
    sent_to: usize = 0,

    pub fn init(gpa: Allocator, cfg: msg.Config) Session {
        return .{
            .gpa = gpa,
            .model = if (cfg.model) |m| gpa.dupe(u8, m) catch oom() else null,
            .delta = cfg.asks == .delta,
        };
    }

    pub fn deinit(s: *Session) void {
        const gpa = s.gpa;
        if (s.model) |m| gpa.free(m);
        if (s.running) |*r| freePhase(gpa, &r.phase);
        for (s.queue.items) |q| gpa.free(q.prompt);
        s.queue.deinit(gpa);
        for (s.transcript.items) |f| gpa.free(f);
        s.transcript.deinit(gpa);
        s.* = undefined;
    }

    fn freePhase(gpa: Allocator, phase: *Phase) void {
        switch (phase.*) {
            .asking => {},
            .calls => |*slots| {
                for (slots.items) |sl| gpa.free(sl.text);
                slots.deinit(gpa);
            },
        }
        phase.* = .{ .asking = 0 };
    }

    /// A deep copy of `s` whose every allocation belongs to `gpa`.
    pub fn clone(s: *const Session, gpa: Allocator) Session {
        var c: Session = .{
            .gpa = gpa,
            .counter = s.counter,
            .max_turn = s.max_turn,
            .delta = s.delta,
            .sent_from = s.sent_from,
            .sent_to = s.sent_to,
        };
        if (s.model) |m| c.model = gpa.dupe(u8, m) catch oom();
        if (s.running) |r| {
            c.running = .{ .turn = r.turn, .phase = switch (r.phase) {
                .asking => |id| .{ .asking = id },
                .calls => |slots| blk: {
                    var list: std.ArrayList(Slot) = std.ArrayList(Slot).initCapacity(gpa, slots.items.len) catch oom();
                    for (slots.items) |sl| {
                        var copy = sl;
                        copy.text = gpa.dupe(u8, sl.text) catch oom();
                        list.appendAssumeCapacity(copy);
                    }
                    break :blk .{ .calls = list };
                },
            } };
        }
        c.queue.ensureTotalCapacity(gpa, s.queue.items.len) catch oom();
        for (s.queue.items) |q| c.queue.appendAssumeCapacity(.{ .turn = q.turn, .prompt = gpa.dupe(u8, q.prompt) catch oom() });
        c.transcript.ensureTotalCapacity(gpa, s.transcript.items.len) catch oom();
        for (s.transcript.items) |f| c.transcript.appendAssumeCapacity(gpa.dupe(u8, f) catch oom());
        return c;
    }

    fn nextId(s: *Session) u64 {
        // 2^64 ids cannot be used up by a real session; trap rather than reuse one.
        s.counter = std.math.add(u64, s.counter, 1) catch @panic("ids exhausted");
        return s.counter;
    }

    fn push(s: *Session, m: msg.Message) void {
        s.transcript.ensureUnusedCapacity(s.gpa, 1) catch oom();
        s.transcript.appendAssumeCapacity(msg.encodeMessage(s.gpa, m));
    }

    /// Asks the model, with the whole transcript (or, with `delta`, what it
    /// has not been sent), under a new id.
    fn ask(s: *Session, a: *Answer) void {
        const r = &s.running.?;
        const id = s.nextId();
        r.phase = .{ .asking = id };
        if (s.delta) {
            s.sent_from = s.sent_to;
            s.sent_to = s.transcript.items.len;
        }
        if (!a.quiet) s.writeAsk(id, a);
    }

    /// The Model action with id `id`: the model and the whole transcript, or
    /// with `delta` the messages of the last ask's range and where it starts.
    /// While the ask is pending nothing is added to the transcript, so writing
    /// it again gives the bytes it was dispatched with.
    fn writeAsk(s: *const Session, id: u64, a: *Answer) void {
        const from = if (s.delta) s.sent_from else 0;
        const messages = s.transcript.items[from..];
        var need: usize = 128;
        if (s.model) |m| need +|= m.len *| 6;
        for (messages) |f| need +|= f.len + 1;
        a.reserve(need);
        const w = a.open(id);
        w.writeAll("{\"Model\":{") catch oom();
        if (s.model) |m| {
            w.writeAll("\"model\":") catch oom();
            msg.writeString(w, m) catch oom();
            w.writeByte(',') catch oom();
        }
        if (s.delta) {
            w.writeAll("\"from\":") catch oom();
            msg.writeInt(w, from) catch oom();
            w.writeByte(',') catch oom();
        }
        w.writeAll("\"messages\":") catch oom();
        writeMessages(w, messages);
        w.writeAll("}}") catch oom();
        a.close();
    }

    /// The transcript from message `from` on (none past its end), as a JSON
    /// array: what a client of a `delta` session reads when it has lost track.
    pub fn writeTranscript(s: *const Session, from: usize, buf: *Writer.Allocating) void {
        const messages = s.transcript.items[@min(from, s.transcript.items.len)..];
        var need: usize = 2;
        for (messages) |f| need +|= f.len + 1;
        buf.ensureTotalCapacityPrecise(buf.writer.end +| need) catch oom();
        writeMessages(&buf.writer, messages);
    }

    /// The actions dispatched and still waited for, in the bytes `step` wrote
    /// them: the running turn's ask, or its calls without a result in id order.
    /// Nothing when no turn runs. `arena` is scratch.
    ///
    /// A call's bytes are not kept: they are re-derived from the Dispatch
    /// entries of the last transcript message, the Agent message `dispatch`
    /// pushed (nothing is pushed while calls are waited for, and the snapshot
    /// decoder checks that this message matches the slots). Its calls were
    /// written from the same decoded Call as the dispatched action, and the
    /// encoding is canonical, so they read back to the same bytes.
    pub fn writePending(s: *const Session, arena: Allocator, a: *Answer) void {
        const r = s.running orelse return;
        switch (r.phase) {
            .asking => |id| s.writeAsk(id, a),
            .calls => |slots| {
                const ds = dispatched(arena, s.transcript.items) orelse @panic("calls are waited for and the last message is not their dispatch");
                for (slots.items) |sl| {
                    if (!sl.pending) continue;
                    for (ds) |d| {
                        if (d.id == sl.id) {
                            a.call(d.id, d.call);
                            break;
                        }
                    } else @panic("a pending call is not in the transcript");
                }
            },
        }
    }

    fn start(s: *Session, turn: u64, prompt: []const u8, a: *Answer) void {
        s.push(.{ .user = prompt });
        s.running = .{ .turn = turn, .phase = .{ .asking = 0 } };
        s.ask(a);
    }

    /// Ends the running turn (its phase already freed) and starts the next queued one.
    fn finish(s: *Session, complete: bool, a: *Answer) void {
        const turn = s.running.?.turn;
        s.running = null;
        a.save(s.nextId());
        a.done(s.nextId(), turn, complete);
        if (s.queue.items.len != 0) {
            const q = s.queue.orderedRemove(0);
            defer s.gpa.free(q.prompt);
            s.start(q.turn, q.prompt, a);
        }
    }

    /// Tool messages for every call of the answer, in id order, then frees the slots.
    fn closeCalls(s: *Session, r: *Running) void {
        const slots = &r.phase.calls;
        for (slots.items) |sl| {
            s.push(.{ .tool = .{
                .id = sl.id,
                .text = if (sl.pending) "cancelled" else sl.text,
                .failed = if (sl.pending) true else sl.failed,
            } });
        }
        freePhase(s.gpa, &r.phase);
    }

    fn ignore(s: *Session, id: u64) void {
        s.ignored = id;
    }

    /// Whether the session refuses `ev` as it stands, changing nothing (the
    /// host is answered MALFORMED). Only a Summary can be: one whose `upto`
    /// keeps nothing of what it replaces or runs past the transcript, that
    /// would keep a call's result (a Tool message) without its call, or would
    /// replace the Agent message whose calls are still waited for.
    pub fn refuses(s: *const Session, ev: msg.Event) bool {
        const sm = switch (ev) {
            .summary => |sm| sm,
            else => return false,
        };
        const len = s.transcript.items.len;
        if (sm.upto == 0 or sm.upto > len) return true;
        const upto: usize = @intCast(sm.upto);
        if (upto < len and isKind(s.transcript.items[upto], "Tool")) return true;
        if (s.running) |r| switch (r.phase) {
            .calls => if (upto == len) return true,
            .asking => {},
        };
        return false;
    }

    /// How many messages of the whole conversation the transcript's first
    /// message stands for: a Summary's count, else none.
    fn replaced(s: *const Session, arena: Allocator) u64 {
        if (s.transcript.items.len == 0 or !isKind(s.transcript.items[0], "Summary")) return 0;
        const m = msg.parseMessage(arena, s.transcript.items[0]) catch @panic("a Summary message the core wrote does not read back");
        return m.summary.replaced;
    }

    /// Replaces the transcript's first `upto` messages with one Summary (the
    /// caller checked `refuses`). A turn waiting on its ask is asked again
    /// with what is left, under a new id: the old ask's answer is ignored.
    /// A delta session's next ask carries everything again, from 0.
    fn summarize(s: *Session, sm: msg.Summarize, a: *Answer) void {
        const upto: usize = @intCast(sm.upto);
        var scratch: std.heap.ArenaAllocator = .init(s.gpa);
        defer scratch.deinit();
        const before = s.replaced(scratch.allocator());
        const had_summary: usize = @intFromBool(isKind(s.transcript.items[0], "Summary"));
        const count = before + (upto - had_summary);
        const summary = msg.encodeMessage(s.gpa, .{ .summary = .{ .text = sm.text, .replaced = count } });
        for (s.transcript.items[0..upto]) |f| s.gpa.free(f);
        s.transcript.replaceRangeAssumeCapacity(0, upto, &.{summary});
        if (s.delta) {
            s.sent_from = 0;
            s.sent_to = 0;
        }
        if (s.running) |r| switch (r.phase) {
            .asking => s.ask(a),
            .calls => {},
        };
    }

    /// Applies one decoded event, writing the actions it asks for to `a`.
    pub fn step(s: *Session, ev: msg.Event, a: *Answer) void {
        s.ignored = null;
        switch (ev) {
            .timer => {},
            .summary => |sm| s.summarize(sm, a),
            .turn => |t| {
                if (t.id <= s.max_turn) return;
                s.max_turn = t.id;
                if (s.running != null) {
                    s.queue.ensureUnusedCapacity(s.gpa, 1) catch oom();
                    s.queue.appendAssumeCapacity(.{ .turn = t.id, .prompt = s.gpa.dupe(u8, t.prompt) catch oom() });
                    a.save(s.nextId());
                } else s.start(t.id, t.prompt, a);
            },
            .model => |m| {
                const r = if (s.running) |*r| r else return s.ignore(m.id);
                switch (r.phase) {
                    .asking => |id| if (id != m.id) return s.ignore(m.id),
                    .calls => return s.ignore(m.id),
                }
                const reply = m.reply;
                if (reply.calls.len == 0) {
                    if (reply.text) |text| {
                        s.push(.{ .agent = .{ .text = text } });
                        a.emit(s.nextId(), text);
                    }
                    s.finish(true, a);
                    return;
                }
                s.dispatch(r, reply, a);
            },
            .result => |res| {
                const r = if (s.running) |*r| r else return s.ignore(res.out.id);
                const slots = switch (r.phase) {
                    .calls => |*slots| slots,
                    .asking => return s.ignore(res.out.id),
                };
                var left: usize = 0;
                var hit: ?*Slot = null;
                for (slots.items) |*sl| {
                    if (!sl.pending) continue;
                    if (sl.id == res.out.id and sl.family == res.family) hit = sl else left += 1;
                }
                const sl = hit orelse return s.ignore(res.out.id);
                sl.text = s.gpa.dupe(u8, res.out.text) catch oom();
                sl.failed = res.out.failed;
                sl.pending = false;
                if (left == 0) {
                    s.closeCalls(r);
                    s.ask(a);
                }
            },
            .cancel => |turn| {
                if (s.running) |*r| if (r.turn == turn) {
                    switch (r.phase) {
                        .calls => s.closeCalls(r),
                        .asking => {},
                    }
                    s.finish(false, a);
                    return;
                };
                for (s.queue.items, 0..) |q, i| if (q.turn == turn) {
                    s.gpa.free(q.prompt);
                    _ = s.queue.orderedRemove(i);
                    a.save(s.nextId());
                    a.done(s.nextId(), turn, false);
                    return;
                };
            },
        }
    }

    /// The model answered with calls: record them, dispatch the ones that may
    /// be (see `Call.refusal`), and ask again at once if none was.
    fn dispatch(s: *Session, r: *Running, reply: msg.Reply, a: *Answer) void {
        const gpa = s.gpa;
        const n = reply.calls.len;
        const first = s.counter + 1;
        if (std.math.maxInt(u64) - s.counter < n) @panic("ids exhausted");
        s.counter += n;

        const ds = gpa.alloc(msg.Dispatch, n) catch oom();
        defer gpa.free(ds);
        for (reply.calls, 0..) |c, i| ds[i] = .{ .id = first + i, .call = c };
        s.push(.{ .agent = .{ .text = reply.text, .calls = ds } });

        var slots = std.ArrayList(Slot).initCapacity(gpa, n) catch oom();
        var pending: usize = 0;
        for (reply.calls, 0..) |c, i| {
            const id = first + i;
            var text: Writer.Allocating = .init(gpa);
            if (c.refusal(&text.writer) catch oom()) {
                slots.appendAssumeCapacity(.{
                    .id = id,
                    .family = c.family(),
                    .pending = false,
                    .failed = true,
                    .text = text.toOwnedSlice() catch oom(),
                });
                continue;
            }
            slots.appendAssumeCapacity(.{ .id = id, .family = c.family(), .pending = true, .failed = false, .text = &.{} });
            pending += 1;
            a.call(id, c);
        }
        r.phase = .{ .calls = slots };
        if (pending == 0) {
            s.closeCalls(r);
            s.ask(a);
        }
    }
};
