//! The core's allocator: slots for what is small, runs of pages for the rest,
//! every page taken from one list of free runs.
//!
//! Up to 32 KiB, a slot of the next power of two (16 B at least), cut from
//! pages of its own size and kept on that size's free list once freed. Past
//! that, an exact run of 64 KiB pages: taken first-fit from the free runs
//! (merged with their free neighbours), else by growing the last free run
//! when it ends memory, else grown at the end; and grown or shrunk in place
//! where the pages beside it allow.
//!
//! Why: linear memory never shrinks, so its high-water mark is what a session
//! costs the host. std's wasm allocator rounds a large allocation up to a
//! power of two pages and reuses it only for that same power (a 4 MiB prompt
//! held 8 MiB, each copy of it as much again); and exact runs alone, beside
//! std's slots, fragment: std grows memory for each new page of slots, which
//! walls in the run freed before it, so an ask that grows a little at every
//! step took new pages at every step (a turn of 20 KB results ran out of its
//! 64 MiB at call 132). Here the slots' pages come from the free runs too.
const std = @import("std");
const builtin = @import("builtin");
const Allocator = std.mem.Allocator;
const Alignment = std.mem.Alignment;

pub const page = std.wasm.page_size;
const wasm = builtin.cpu.arch.isWasm();

pub const allocator: Allocator = .{
    .ptr = undefined,
    .vtable = &.{ .alloc = alloc, .resize = resize, .remap = remap, .free = free },
};

/// A free run of pages, recorded in its own first bytes. The runs are kept in
/// address order, and no two of them touch.
const Run = struct { pages: usize, next: ?*Run };
var free_runs: ?*Run = null;

const min_slot_log2 = 4;
const max_slot_log2 = 15;
const classes = max_slot_log2 - min_slot_log2 + 1;

/// A free slot, its first word linking the next free one of its size.
const Slot = struct { next: ?*Slot };
var free_slots: [classes]?*Slot = @splat(null);
/// The next slot never used in each size's newest page; 0 when there is none.
var fresh: [classes]usize = @splat(0);

/// The slot size class of an allocation, or null when it takes pages.
fn slotClass(len: usize, alignment: Alignment) ?usize {
    const size = @max(len, alignment.toByteUnits(), 1 << min_slot_log2);
    if (size > 1 << max_slot_log2) return null;
    return std.math.log2_int_ceil(usize, size) - min_slot_log2;
}

pub fn pagesFor(len: usize) usize {
    return len / page + @intFromBool(len % page != 0);
}

fn endOf(r: *const Run) usize {
    return @intFromPtr(r) + r.pages * page;
}

pub fn memoryEnd() usize {
    if (!wasm) return @intFromPtr(&native.memory) + native.pages * page;
    return @wasmMemorySize(0) * page;
}

/// The address of n new pages at the end of memory, or null when the host's
/// cap refuses them.
fn grow(n: usize) ?usize {
    if (!wasm) return native.grow(n);
    const before = @wasmMemoryGrow(0, n);
    if (before < 0) return null;
    return @as(usize, @intCast(before)) * page;
}

/// Linear memory as the native unit tests (`zig build test`) see it: 64 MiB
/// that only grows.
pub const native = struct {
    pub var memory: [1024 * page]u8 align(page) = undefined;
    var pages: usize = 0;

    /// Forgets every allocation: a test starts from empty memory.
    pub fn reset() void {
        pages = 0;
        free_runs = null;
        free_slots = @splat(null);
        fresh = @splat(0);
    }

    fn grow(n: usize) ?usize {
        if (n > memory.len / page - pages) return null;
        defer pages += n;
        return @intFromPtr(&memory) + pages * page;
    }
};

fn alloc(_: *anyopaque, len: usize, alignment: Alignment, _: usize) ?[*]u8 {
    if (slotClass(len, alignment)) |c| return @ptrFromInt(takeSlot(c) orelse return null);
    if (alignment.toByteUnits() > page) return null;
    return @ptrFromInt(take(pagesFor(len)) orelse return null);
}

fn resize(_: *anyopaque, memory: []u8, alignment: Alignment, new_len: usize, _: usize) bool {
    if (slotClass(memory.len, alignment)) |c| return slotClass(new_len, alignment) == c;
    if (slotClass(new_len, alignment) != null) return false;
    const addr = @intFromPtr(memory.ptr);
    const have = pagesFor(memory.len);
    const want = pagesFor(new_len);
    if (want < have) give(addr + want * page, have - want);
    return want <= have or takeAt(addr + have * page, want - have);
}

fn remap(ctx: *anyopaque, memory: []u8, alignment: Alignment, new_len: usize, ret_addr: usize) ?[*]u8 {
    return if (resize(ctx, memory, alignment, new_len, ret_addr)) memory.ptr else null;
}

fn free(_: *anyopaque, memory: []u8, alignment: Alignment, _: usize) void {
    if (slotClass(memory.len, alignment)) |c| {
        const slot: *Slot = @ptrCast(@alignCast(memory.ptr));
        slot.* = .{ .next = free_slots[c] };
        free_slots[c] = slot;
        return;
    }
    give(@intFromPtr(memory.ptr), pagesFor(memory.len));
}

/// A slot of class c: a freed one, else the next in its size's newest page,
/// else the first of a new page.
fn takeSlot(c: usize) ?usize {
    if (free_slots[c]) |slot| {
        free_slots[c] = slot.next;
        return @intFromPtr(slot);
    }
    if (fresh[c] == 0) fresh[c] = take(1) orelse return null;
    const addr = fresh[c];
    const size = @as(usize, 1) << @intCast(c + min_slot_log2);
    fresh[c] = if ((addr + size) % page == 0) 0 else addr + size;
    return addr;
}

/// The address of n pages: the first free run with room, else the last run
/// grown by what it lacks when it ends memory, else new pages.
fn take(n: usize) ?usize {
    var link: *?*Run = &free_runs;
    while (link.*) |r| : (link = &r.next) {
        if (r.pages >= n) return cut(link, r, n);
        if (takeGrown(link, r, n)) return @intFromPtr(r);
    }
    return grow(n);
}

/// Whether the n pages at addr (those just past an allocation) are now the
/// allocation's: free, or grown past the end of memory.
fn takeAt(addr: usize, n: usize) bool {
    if (addr == memoryEnd()) return grow(n) != null;
    var link: *?*Run = &free_runs;
    while (link.*) |r| : (link = &r.next) {
        if (@intFromPtr(r) < addr) continue;
        if (@intFromPtr(r) > addr) return false;
        if (r.pages >= n) {
            _ = cut(link, r, n);
            return true;
        }
        return takeGrown(link, r, n);
    }
    return false;
}

/// Whether the free run r (found at link), too short for n pages, is now
/// taken whole, grown to n: only when it is the last run and ends memory.
fn takeGrown(link: *?*Run, r: *Run, n: usize) bool {
    if (r.next != null or endOf(r) != memoryEnd()) return false;
    _ = grow(n - r.pages) orelse return false;
    link.* = null;
    return true;
}

/// Takes the first n pages of the free run r (found at link) and returns
/// their address.
fn cut(link: *?*Run, r: *Run, n: usize) usize {
    const addr = @intFromPtr(r);
    if (r.pages == n) {
        link.* = r.next;
    } else {
        const rest: *Run = @ptrFromInt(addr + n * page);
        rest.* = .{ .pages = r.pages - n, .next = r.next };
        link.* = rest;
    }
    return addr;
}

/// Makes the n pages at addr a free run, merged with the runs beside it.
fn give(addr: usize, n: usize) void {
    var prev: ?*Run = null;
    var next = free_runs;
    while (next) |r| : (next = r.next) {
        if (@intFromPtr(r) > addr) break;
        prev = r;
    }
    const run: *Run = @ptrFromInt(addr);
    run.* = .{ .pages = n, .next = next };
    if (next) |r| if (endOf(run) == @intFromPtr(r)) {
        run.pages += r.pages;
        run.next = r.next;
    };
    const p = prev orelse {
        free_runs = run;
        return;
    };
    if (endOf(p) == addr) {
        p.pages += run.pages;
        p.next = run.next;
    } else {
        p.next = run;
    }
}
