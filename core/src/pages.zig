//! The core's allocator. What fits in a 64 KiB wasm page is std's
//! (`std.heap.wasm_allocator`: size classes, quick). Anything larger is an
//! exact run of pages, taken first-fit from the runs freed before (merged
//! with their free neighbours) or grown at the end of memory, and grown or
//! shrunk in place where the pages beside it allow.
//!
//! Why: std rounds a large allocation up to a power of two pages and reuses
//! it only for that same power, so a 4 MiB prompt held 8 MiB, each copy of it
//! as much again, and pages freed by one size were never used by another.
//! Linear memory never shrinks, so its high-water mark is what a session costs
//! the host; this keeps it near what the session holds.
const std = @import("std");
const builtin = @import("builtin");
const Allocator = std.mem.Allocator;
const Alignment = std.mem.Alignment;

pub const page = std.wasm.page_size;
const wasm = builtin.cpu.arch.isWasm();
const small = if (wasm) std.heap.wasm_allocator else std.heap.page_allocator;

pub const allocator: Allocator = .{
    .ptr = undefined,
    .vtable = &.{ .alloc = alloc, .resize = resize, .remap = remap, .free = free },
};

/// A free run of pages, recorded in its own first bytes. The runs are kept in
/// address order, and no two of them touch.
const Run = struct { pages: usize, next: ?*Run };
var free_runs: ?*Run = null;

/// Whether std would leave its size classes for len (it keeps a word beside
/// each slot), so std is only ever asked for what fits a page.
fn large(len: usize) bool {
    return len +| @sizeOf(usize) > page;
}

fn pagesFor(len: usize) usize {
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
    }

    fn grow(n: usize) ?usize {
        if (n > memory.len / page - pages) return null;
        defer pages += n;
        return @intFromPtr(&memory) + pages * page;
    }
};

fn alloc(_: *anyopaque, len: usize, alignment: Alignment, ret_addr: usize) ?[*]u8 {
    if (!large(len)) return small.rawAlloc(len, alignment, ret_addr);
    if (alignment.toByteUnits() > page) return null;
    return @ptrFromInt(take(pagesFor(len)) orelse return null);
}

fn resize(_: *anyopaque, memory: []u8, alignment: Alignment, new_len: usize, ret_addr: usize) bool {
    if (!large(memory.len)) return !large(new_len) and small.rawResize(memory, alignment, new_len, ret_addr);
    if (!large(new_len)) return false;
    const addr = @intFromPtr(memory.ptr);
    const have = pagesFor(memory.len);
    const want = pagesFor(new_len);
    if (want < have) give(addr + want * page, have - want);
    return want <= have or takeAt(addr + have * page, want - have);
}

fn remap(ctx: *anyopaque, memory: []u8, alignment: Alignment, new_len: usize, ret_addr: usize) ?[*]u8 {
    return if (resize(ctx, memory, alignment, new_len, ret_addr)) memory.ptr else null;
}

fn free(_: *anyopaque, memory: []u8, alignment: Alignment, ret_addr: usize) void {
    if (!large(memory.len)) return small.rawFree(memory, alignment, ret_addr);
    give(@intFromPtr(memory.ptr), pagesFor(memory.len));
}

/// The address of n pages: the first free run with room, else the last run
/// grown by what it lacks when it ends memory, else new pages.
fn take(n: usize) ?usize {
    var link: *?*Run = &free_runs;
    while (link.*) |r| : (link = &r.next) {
        if (r.pages >= n) return cut(link, r, n);
        if (r.next == null and endOf(r) == memoryEnd()) {
            _ = grow(n - r.pages) orelse return null;
            link.* = null;
            return @intFromPtr(r);
        }
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
        if (r.next != null or endOf(r) != memoryEnd()) return false;
        _ = grow(n - r.pages) orelse return false;
        link.* = null;
        return true;
    }
    return false;
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
