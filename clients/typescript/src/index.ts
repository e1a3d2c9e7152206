/**
 * devd-client: a typed client of devd (`connect`), and the turn driver (`runTurn`, `resumeTurn`).
 *
 * The protocol's types are generated from the daemon's own by `devd schema --typescript`: import them from
 * `devd-client/types` (`import type { Op } from "devd-client/types"`), or use the `protocol` namespace here (its
 * `Client` is who calls, in `initialize`; this module's `Client` is the connection).
 */

export * from "./client.js";
export * from "./driver.js";
export type * as protocol from "./types.js";
