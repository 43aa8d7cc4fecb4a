"""CPU CI for the backward walks' synchronisation (``hopper/bwd_walk.py``): each role's mbarrier waits and arrivals,
its named-barrier syncs, proxy fences and shared-tile accesses, read from the kernel builder's own source and
replayed over several chunks under many interleavings.

A warp-specialised kernel hangs on the GPU if a wait can never be met (a count no role completes, a cycle of
waits) or if a role falls two phases behind a barrier it polls by parity (the wait then blocks on a phase already
passed); it computes garbage if two roles touch a shared tile, one writing, with nothing ordering them, or if a
wgmma reads a tile written by ordinary stores with no proxy fence between. The replay finds each: a run that cannot
finish, a wait that observes a phase other than the one after its last, two accesses no chain of barriers orders
(vector clocks), a wgmma read ordered after an unfenced write.

The model: a producer warp is one unit; a consumer warpgroup is two units (its two halves, each running the whole
program: a named-barrier sync is where the halves meet), so a tile written by one statement and read by another of
the same warpgroup needs a sync between. Accesses are to whole tiles (or slots of a ring); the accesses of one
statement by the two halves are to disjoint elements and never a race. A TMA's completion is its warp's arrival
(the bytes are not modelled); a branch on the thread id runs in the halves whose first thread takes it (one chunk's
row count taken as 64).
"""
from __future__ import annotations

import ast
import inspect
import random
import textwrap

import pytest

NCHUNKS = (1, 2, 3, 4, 7)
SEEDS = range(32)


def _const(node, env=None):
    return eval(compile(ast.Expression(node), "<protocol>", "eval"), {}, dict(env or {}))


def _names(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _call(stmt, name):
    """``stmt`` as a call of ``T.<name>`` or of the bare macro ``name``, or None."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    f = stmt.value.func
    hit = (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name)
    return stmt.value if hit else None


def _tile(node, shared):
    """The shared buffer an expression names, as (name, slot node or None): a leading index is the slot of a ring
    if it evaluates at unroll time (one of an element, ``q_sh[i, j]``, does not: the whole tile)."""
    base = node.value if isinstance(node, ast.Subscript) else node
    if not (isinstance(base, ast.Name) and base.id in shared):
        return None
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) >= 2:
        first = node.slice.elts[0]
        if not isinstance(first, ast.Slice):
            return base.id, first
    return base.id, None


def _reads(node, shared):
    """The shared buffers an expression reads (a subscript's buffer name is not a second read)."""
    inner = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Subscript)}
    out, seen = [], set()
    for n in ast.walk(node):
        if isinstance(n, (ast.Subscript, ast.Name)) and id(n) not in inner and (t := _tile(n, shared)):
            key = (t[0], ast.unparse(t[1]) if t[1] is not None else None)
            if key not in seen:
                seen.add(key)
                out.append(t)
    return out


def _accesses(stmt, shared):
    """One statement's shared-tile accesses (its nested loops included) as ("read" | "write", buffer, slot node,
    how, statement): how is "gemm" for a wgmma's read, "tma" for the producer's load, else "generic"."""
    out = []

    def add(kind, t, how):
        if t:
            out.append((kind,) + tuple(t) + (how, id(stmt)))

    for n in ast.walk(stmt):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "gemm":
                for a in n.args[:2]:
                    add("read", _tile(a, shared), "gemm")
            elif name == "copy":
                add("read", _tile(n.args[0], shared), "generic")
                add("write", _tile(n.args[1], shared), "generic")
            elif name in ("tma_copy", "load_tile"):
                add("write", _tile(n.args[1], shared), "tma")
            elif name == "refill":
                add("write", _tile(n.args[3], shared), "tma")
            elif name == "load_slot":
                add("write", (n.args[1].id, n.args[2]), "tma")
        elif isinstance(n, (ast.Assign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for tg in targets:
                add("write", _tile(tg, shared), "generic")
            for t in _reads(n.value, shared):
                add("read", t, "generic")
            if isinstance(n, ast.AugAssign):
                add("read", _tile(n.target, shared), "generic")
    return out


def _has_barrier(items):
    return any(o[0] in ("wait", "arrive", "sync") or (o[0] in ("if", "txif") and _has_barrier(o[2] + o[3]))
               or (o[0] == "for" and _has_barrier(o[3])) for o in items)


def _ops(stmts, shared):
    """A loop body's synchronisation and accesses, as templates over the chunk index ``it`` and the thread ``tx``."""
    out = []
    for s in stmts:
        if _call(s, "sync_threads") is not None:
            out.append(("sync",))
        elif _call(s, "fence_proxy_async") is not None:
            out.append(("fence",))
        elif (c := _call(s, "barrier_wait")) is not None:
            out.append(("wait", c.args[0], c.args[1]))
        elif (c := _call(s, "barrier_arrive")) is not None:
            out.append(("arrive", c.args[0]))
        elif (c := _call(s, "refill")) is not None:
            # the shared macro: wait for the tile's release by the chunk before, then load it
            out.append(("if", ast.parse("it > 0", mode="eval").body,
                        [("wait", c.args[0], ast.parse("(it - 1) % 2", mode="eval").body)], []))
            out += _accesses(s, shared)
        elif isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            out.append(("let", s.targets[0].id, s.value))
            out += _accesses(s, shared)
        elif isinstance(s, ast.If):
            body, orelse = _ops(s.body, shared), _ops(s.orelse, shared)
            if "tx" in _names(s.test):
                # some of the role's threads: no barrier op may be inside (its arrivals would not count)
                assert not _has_barrier(body + orelse), ast.unparse(s)
                out.append(("txif", s.test, body, orelse))
                continue
            out += [("read",) + tuple(t) + ("generic", id(s)) for t in _reads(s.test, shared)]
            out.append(("if", s.test, body, orelse))
        elif (isinstance(s, ast.For) and isinstance(s.iter, ast.Call) and ast.unparse(s.iter.func) == "T.serial"
              and isinstance(s.target, ast.Name)):
            out.append(("for", s.target.id, s.iter.args[0], _ops(s.body, shared)))
        elif isinstance(s, (ast.For, ast.With)):
            assert not _has_barrier(_ops(s.body, shared)), f"a barrier op in a nested loop: {ast.unparse(s)[:80]}"
            out += _accesses(s, shared)
        else:
            out += _accesses(s, shared)
    return out


def _barrier(node, env):
    if isinstance(node, ast.Subscript):
        return node.value.id, _const(node.slice, env)
    return node.id, 0


def _slot(node, env):
    try:
        return _const(node, env)
    except (NameError, TypeError):
        return None


def _unroll(templates, env, tx):
    """One unit's ops: ("wait", barrier, index, parity), ("arrive", barrier, index), ("sync",), ("fence",),
    (kind, buffer, slot, how, statement, loop indices)."""
    ops = []

    def run(items, env):
        for item in items:
            if item[0] == "let":
                try:
                    env[item[1]] = _const(item[2], env)
                except (NameError, TypeError, AttributeError):
                    pass  # a value the model does not track (an address, a dynamic length): the caller's stays
            elif item[0] == "for":
                for i in range(_const(item[2], env)):
                    inner = dict(env, **{item[1]: i})
                    inner["_at"] = env.get("_at", ()) + (i,)
                    run(item[3], inner)
            elif item[0] == "if":
                run(item[2] if _const(item[1], env) else item[3], env)
            elif item[0] == "txif":
                run(item[2] if _const(item[1], dict(env, tx=tx)) else item[3], env)
            elif item[0] == "wait":
                ops.append(("wait",) + _barrier(item[1], env) + (_const(item[2], env) % 2,))
            elif item[0] == "arrive":
                ops.append(("arrive",) + _barrier(item[1], env))
            elif item[0] in ("read", "write"):
                slot = None if item[2] is None else _slot(item[2], env)
                ops.append((item[0], item[1], slot, item[3], item[4], env.get("_at", ())))
            else:
                ops.append(item)

    run(templates, dict(env))
    return ops


def _branches(node, lo, hi):
    """The role chain ``if tx < a: ... elif tx < b: ... else: ...`` as (lo, hi, body) thread ranges."""
    out = []
    while True:
        cut = _const(node.test.comparators[0])
        out.append((lo, cut, node.body))
        lo = cut
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) and "tx" in _names(node.orelse[0].test):
            node = node.orelse[0]
            continue
        out.append((lo, hi, node.orelse))
        return out


def _is_role_split(stmt):
    return (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare) and isinstance(stmt.test.left, ast.Name)
            and stmt.test.left.id == "tx")


def _roles(body, lo, hi, shared):
    """(first thread, last + 1, loop templates) of every role: a branch's loop over the chunks, or its nested split."""
    roles = []
    for a, b, stmts in _branches(next(s for s in body if _is_role_split(s)), lo, hi):
        if any(_is_role_split(s) for s in stmts):
            roles += _roles(stmts, a, b, shared)
            continue
        roles.append((a, b, _ops(stmts, shared)))
    return roles


def protocol(builder, **args):
    """(barrier arrive counts by name, roles as (first thread, end, templates), threads, environment) of a
    builder's kernel, for the builder arguments ``args`` (the environment: the module's constants, the arguments,
    the builder's own assignments before its kernel)."""
    module = vars(inspect.getmodule(builder))
    env = {k: v for k, v in module.items() if isinstance(v, (int, float, bool, str))}
    env.update(args)
    tree = ast.parse(textwrap.dedent(inspect.getsource(builder)))
    func = tree.body[0]
    for stmt in func.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            try:
                env[stmt.targets[0].id] = _const(stmt.value, env)
            except Exception:  # T.dynamic and the like: not a constant
                pass
    counts, shared = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            attr = getattr(node.value.func, "attr", None)
            if attr == "alloc_barrier":
                value = _const({k.arg: k.value for k in node.value.keywords}["arrive_count"])
                counts[node.targets[0].id] = value if isinstance(value, list) else [value]
            elif attr == "alloc_shared":
                shared.add(node.targets[0].id)
    kernel = next(n for n in ast.walk(tree) if isinstance(n, ast.With)
                  and ast.unparse(n.items[0].context_expr).startswith("T.Kernel("))
    threads_node = next(k.value for k in kernel.items[0].context_expr.keywords if k.arg == "threads")
    threads = _const(threads_node, env)
    return counts, _roles(kernel.body, 0, threads, frozenset(shared)), threads, env


def _units(roles, env, split):
    """(role, threads, ops) of each unit: a producer warp whole, a warpgroup (or more) as two halves that meet at
    each named-barrier sync (a barrier of the role's own: both halves arrive, then wait for its phase), or whole
    where ``split`` is off (its syncs then order nothing the model sees)."""
    units = []
    for r, (lo, hi, tmpl) in enumerate(roles):
        parts = [(lo, hi)] if hi - lo < 128 or not split else [(lo, (lo + hi) // 2), ((lo + hi) // 2, hi)]
        for a, b in parts:
            ops, syncs = [], 0
            for op in _unroll(tmpl, env, a):
                if op[0] == "sync" and len(parts) == 2:
                    ops += [("arrive", ("sync", r), 0), ("wait", ("sync", r), 0, syncs % 2)]
                    syncs += 1
                elif op[0] == "sync":
                    pass
                else:
                    ops.append(op)
            units.append((r, b - a, ops))
    return units


def _fence_ticks(ops):
    """For each generic write, the unit's clock at its first proxy fence after it (None: never fenced). A unit's
    clock ticks once an op, so op j runs at tick j + 1."""
    out, open_writes = {}, []
    for i, op in enumerate(ops):
        if op[0] == "write" and op[3] == "generic":
            open_writes.append(i)
        elif op[0] == "fence":
            out.update(dict.fromkeys(open_writes, i + 1))
            open_writes = []
    return out


def replay(counts, roles, env, seed, split=True, private=frozenset()):
    """Runs every unit's ops under one interleaving (random, or each seed's fixed unit priority). Returns (the ops
    units could not get past, barriers left half-arrived, hazards): all empty when the walk finished cleanly.
    ``private``: tiles each thread reads back only where it wrote them itself (a warpgroup's halves never meet
    there)."""
    rng = random.Random(seed)
    units = _units(roles, env, split)
    U = len(units)
    counts = {**counts, **{("sync", r): [hi - lo] for r, (lo, hi, _) in enumerate(roles)}}
    fences = [_fence_ticks(ops) for _, _, ops in units]
    priority = list(range(U))
    rng.shuffle(priority)
    greedy = seed % 2 == 1  # odd seeds run one unit as far ahead as it can go, the next, and so on
    phase = {(b, i): 0 for b, cs in counts.items() for i in range(len(cs))}
    pending = dict.fromkeys(phase, 0)
    gathered = {k: [0] * U for k in phase}
    completed = {}
    clock = [[0] * U for _ in range(U)]
    history = {}
    hazards = []
    seen = {}
    pc = [0] * U

    def ready(u):
        if pc[u] == len(units[u][2]):
            return False
        op = units[u][2][pc[u]]
        return op[0] != "wait" or phase[op[1:3]] % 2 != op[3]

    while True:
        runnable = [u for u in range(U) if ready(u)]
        if not runnable:
            break
        u = min(runnable, key=priority.index) if greedy else rng.choice(runnable)
        role, weight, ops = units[u]
        op = ops[pc[u]]
        clock[u][u] += 1
        key = op[1:3]
        if op[0] == "arrive":
            gathered[key] = [max(a, b) for a, b in zip(gathered[key], clock[u])]
            pending[key] += weight
            assert pending[key] <= counts[key[0]][key[1]], f"{key}: more arrivals than its count"
            if pending[key] == counts[key[0]][key[1]]:
                completed[key + (phase[key],)] = gathered[key]
                phase[key] += 1
                pending[key] = 0
                gathered[key] = [0] * U
        elif op[0] == "wait":
            # the phase this wait observed: the latest completed one of its parity
            got = phase[key] - 1
            last = seen.get((u, key))
            assert got == (last + 1 if last is not None else got) and (last is not None or got in (-1, 0)), (
                f"unit {u} waited on {key} and observed phase {got} after {last}: it fell a phase behind")
            seen[(u, key)] = got
            if got >= 0:
                clock[u] = [max(a, b) for a, b in zip(clock[u], completed[key + (got,)])]
        elif op[0] in ("read", "write"):
            kind, how, stmt = op[0], op[3], op[4:6]
            # each unit's latest read and latest write of the tile: its earlier ones are ordered no later
            for p, pkind, pstmt, stamp, fence in [e for d in history.get(key, {}).values() for e in d.values()]:
                if units[p][0] == role and (p == u or pstmt == stmt or key[0] in private):
                    continue  # the unit's own order; the two halves' elements of one statement, or of a private tile
                ordered = clock[u][p] >= stamp
                if "write" in (kind, pkind) and not ordered:
                    hazards.append(("unordered", key, units[p][0], pkind, role, kind))
                elif ordered and how == "gemm" and fence != "async" and (fence is None or clock[u][p] < fence):
                    # a wgmma reads what ordinary stores wrote: the writer's fence must come before the ordering
                    hazards.append(("unfenced", key, units[p][0], pkind, role, kind))
            fence = fences[u].get(pc[u]) if kind == "write" and how == "generic" else "async"
            history.setdefault(key, {}).setdefault(u, {})[kind] = (u, kind, stmt, clock[u][u], fence)
        pc[u] += 1
    left = [units[u][2][pc[u]] for u in range(U) if pc[u] < len(units[u][2])]
    partial = {k: v for k, v in pending.items() if v}
    return left, partial, hazards


WALK_ARGS = dict(Hk=16, Hv=32, K=128, V=128, dtype="bfloat16", scale=128 ** -0.5, has_dht=True, store_dh0=True)


def _walk(kernel):
    from flashqla_kernels.gated_delta_rule.hopper import bwd_walk

    builder = {"plain": bwd_walk.build_bwd_walk, "ws": bwd_walk.build_bwd_walk_ws}[kernel]
    return protocol(builder, **WALK_ARGS)


def _clean(counts, roles, env, cases, seeds, where, split=True, private=frozenset()):
    for n_it, n in cases:
        for seed in seeds:
            left, partial, hazards = replay(counts, roles, dict(env, n_it=n_it, n=n), seed, split, private)
            assert not left and not partial, f"{where}, {n_it} chunks of {n} rows, seed {seed}: stuck at {left}"
            assert not hazards, f"{where}, {n_it} chunks of {n} rows, seed {seed}: {sorted(set(hazards), key=str)[:4]}"


def test_warp_specialised_walk_synchronisation_is_clean():
    """The warp-specialised walk (every sync its own: the planner's are off) gets through 1 to 7 chunks, full and
    ragged (the producer's masked loads), under 32 interleavings each: no wait left unmet, no barrier half-arrived,
    no wait observing a phase out of turn, no two accesses to a tile unordered with one a write, no wgmma read of an
    unfenced write."""
    counts, roles, threads, env = _walk("ws")
    assert sum(hi - lo for lo, hi, _ in roles) == threads and len(roles) == 7  # S, A, B and four producer warps
    _clean(counts, roles, env, [(k, 64) for k in NCHUNKS] + [(2, 10)], SEEDS, "ws")


def test_plain_walk_barrier_protocol_is_clean():
    """The plain walk's producer / consumer protocol. Its consumers' own syncs are TileLang's, placed by the
    planner and not in the source, so its two consumer warpgroups are one unit here: only the hand-offs between
    the producer's warps and the consumers are checked."""
    counts, roles, threads, env = _walk("plain")
    assert sum(hi - lo for lo, hi, _ in roles) == threads and len(roles) == 5
    _clean(counts, roles, env, [(k, 64) for k in NCHUNKS] + [(2, 10)], range(20), "plain", split=False)


@pytest.mark.parametrize("Hk,Hv,V", [(16, 32, 128), (4, 16, 128), (1, 4, 64)])
def test_grouped_dqkwg_synchronisation_is_clean(Hk, Hv, V):
    """``bwd_dqkwg``'s grouped kernel, also warp-specialised with every hand-off its own mbarrier: value heads of a
    group 2 and 4 (the gate ring reused), one and two V tiles, full and ragged chunks. dq's running sum (``dqa_sh``)
    is each thread's own elements, read back by the thread that wrote them."""
    from flashqla_kernels.gated_delta_rule.hopper import bwd_dqkwg

    counts, roles, threads, env = protocol(bwd_dqkwg.build_bwd_dqkwg_group, Hk=Hk, Hv=Hv, K=128, V=V,
                                           dtype="bfloat16", scale=128 ** -0.5, l2norm=False)
    assert sum(hi - lo for lo, hi, _ in roles) == threads
    _clean(counts, roles, env, [(1, 64), (1, 10)], range(16), f"dqkwg group {Hk}/{Hv}", private={"dqa_sh"})


def _mutated(roles, role, drop):
    """``roles`` with role ``role``'s items for which ``drop(item)`` holds removed (inside branches and loops)."""
    def walk(items):
        out = []
        for o in items:
            if drop(o):
                continue
            if o[0] in ("if", "txif"):
                o = (o[0], o[1], walk(o[2]), walk(o[3]))
            elif o[0] == "for":
                o = (o[0], o[1], o[2], walk(o[3]))
            out.append(o)
        return out
    return [(lo, hi, walk(t) if i == role else t) for i, (lo, hi, t) in enumerate(roles)]


def _failures(counts, roles, env, seeds=range(40)):
    found = set()
    for n_it in (2, 3):
        for seed in seeds:
            try:
                left, partial, hazards = replay(counts, roles, dict(env, n_it=n_it, n=64), seed)
            except AssertionError as e:
                found.add(("assert", str(e).split(":")[0]))
                continue
            found |= {("stuck",)} if left or partial else set()
            found |= {h[:2] for h in hazards}
    return found


def test_replay_finds_a_missing_arrival_a_missing_wait_sync_and_fence():
    """The replay itself, on the warp-specialised walk with one thing taken out each time."""
    counts, roles, _, env = _walk("ws")
    assert ("stuck",) in _failures(dict(counts, ds_free=[384]), roles, env)  # A and B arrive 256 a chunk
    is_wait = (lambda name: lambda o: o[0] == "wait" and ast.unparse(o[1]) == name)
    # A writes Y into dO's tile before S's Q^T Doe has read the Doe there
    assert ("unordered", ("do_sh", None)) in _failures(counts, _mutated(roles, 1, is_wait("doe_done")), env)
    # B reads A's WY tiles before A has formed them
    assert ("unordered", ("a_sh", None)) in _failures(counts, _mutated(roles, 2, is_wait("wy_rdy")), env)
    # S forms Doe in place before B has read dO
    assert ("unordered", ("do_sh", None)) in _failures(counts, _mutated(roles, 0, is_wait("b_do")), env)
    # B reads dP from its tile with no sync after its other half wrote it
    no_sync = _mutated(roles, 2, lambda o: o[0] == "sync")
    assert ("unordered", ("dp_sh", None)) in _failures(counts, no_sync, env)
    # A's dw tile read by B's wgmma with no fence after A's stores
    no_fence = _mutated(roles, 1, lambda o: o[0] == "fence")
    assert ("unfenced", ("dw_sh", None)) in _failures(counts, no_fence, env)
