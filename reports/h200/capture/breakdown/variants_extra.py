import itertools, sys
import torch
from attn_doctor.tracing import record
R = record.Recorder
orig_record, orig_flush_write = R._record, R._write

def lean_record(self, api, bound, qkv, out, te_module):
    names = self._model_names
    if names is None or self.selection.values or not self._in_model:
        return orig_record(self, api, bound, qkv, out, te_module)
    output = out[0] if isinstance(out, (tuple, list)) else out
    if not record._kept_for_backward(output):
        return orig_record(self, api, bound, qkv, out, te_module)
    inner = te_module if te_module is not None else record.innermost_module(sys._getframe(3))
    self._deferred.append((api, bound, qkv, output, te_module, None if te_module is None else record.te_now(),
                           inner, next(self._lean_ordinals)))

def lean_write(self, calls):
    fixed = []
    for call in calls:
        if len(call) == 8:
            api, bound, qkv, output, te_module, te_state, inner, ordinal = call
            path, layer = self._model_names.get(id(inner)) or (type(inner).__name__, None)
            index = self.calls; self.calls += 1
            call = (api, bound, qkv, output, te_module, te_state, index, path, layer if layer is not None else ordinal,
                    self._step, None)
        fixed.append(call)
    return orig_flush_write(self, fixed)

def next_step(self, module, args):
    with self._lock:
        self._step += 1; self._ordinal = 0; self._in_model += 1
    self._lean_ordinals = itertools.count()
orig_next_step = R._next_step
R._lean_ordinals = itertools.count()

def lean(on):
    R._record = lean_record if on else orig_record
    R._write = lean_write if on else orig_flush_write
VARIANTS = {"lean": lean}
from attn_doctor.tracing import describe, store
D, S = describe.CallDescriber, store.CallLog
orig_lines, orig_append, orig_layout = D.lines, S.append, R._layout
CONST = ['{"index":1,"module":"0.x","layer":0,"step":1,"values":null,"signature":0}\n']
def const_noappend(on):
    D.lines = (lambda self, *a, **k: CONST) if on else orig_lines
    S.append = (lambda self, line: None) if on else orig_append
def write_loop_only(on):
    R._write = (lambda self, calls: [None for api, *call in calls]) if on else orig_flush_write
def defer_drop(on):  # calls deferred, then dropped at the forward end
    R._write = (lambda self, calls: None) if on else orig_flush_write
VARIANTS.update({"const-noappend": const_noappend, "write-loop-only": write_loop_only})
import operator
_G = operator.attrgetter("shape", "dtype", "device", "requires_grad")
orig_tk = describe.tensors_key
def tensors_key_no_storage(tensors):
    addresses = [*map(torch.Tensor.data_ptr, tensors)]
    return (*map(_G, tensors), *map(torch.Tensor.stride, tensors), *map(torch.Tensor.storage_offset, tensors),
            *map(addresses.index, addresses)), addresses
def no_storage(on):
    describe.tensors_key = tensors_key_no_storage if on else orig_tk
VARIANTS["no-storage"] = no_storage
def no_record(on):
    R._record = (lambda self, *a: None) if on else orig_record
def where_only(on):
    R._record = (lambda self, api, bound, qkv, out, te_module: self._where(te_module)) if on else orig_record
def frame_only(on):  # the frame walk alone
    R._record = (lambda self, *a: record.innermost_module(sys._getframe(3))) if on else orig_record
orig_where = R._where
def no_where_no_write(on):
    R._where = (lambda self, m: ("", None)) if on else orig_where
    R._write = (lambda self, calls: None) if on else orig_flush_write
def lean_call_only(on):  # the least a call must do: check, walk, keep
    def rec(self, api, bound, qkv, out, te_module):
        output = out[0] if isinstance(out, (tuple, list)) else out
        if record._kept_for_backward(output):
            self._deferred.append((api, bound, qkv, output, te_module, record.innermost_module(sys._getframe(3))))
    R._record = rec if on else orig_record
    R._write = (lambda self, calls: None) if on else orig_flush_write
VARIANTS.update({"no-record": no_record, "where-only": where_only, "frame-only": frame_only,
                 "no-where-no-write": no_where_no_write, "lean-call-only": lean_call_only})
import time
QKV = ("query", "key", "value")
def make_lean_sdpa(rec, original, frame_mode="walk"):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    busy = rec._thread
    pc = time.perf_counter
    kept = record._kept_for_backward
    getframe = sys._getframe
    CALL_IMPL = record._CALL_IMPL
    lock = rec._lock
    def sdpa(*args, **kwargs):
        if busy.busy:
            return original(*args, **kwargs)
        busy.busy = True
        try:
            out = original(*args, **kwargs)
        finally:
            busy.busy = False
        start = pc()
        known = rec._model_names
        if known is not None and rec._in_model and kept(out):
            frame = getframe(1)
            if frame_mode == "walk":
                while frame is not None and frame.f_code is not CALL_IMPL:
                    frame = frame.f_back
            found = known.get(id(frame.f_locals.get("self"))) if frame is not None else None
            if found is not None:
                with lock:
                    index = rec.calls
                    rec.calls = index + 1
                    ordinal = rec._ordinal
                    rec._ordinal = ordinal + 1
                    deferred = rec._deferred
                    deferred.append(("torch.sdpa", dict(zip(names, args)) | kwargs, QKV, out, None, None, index,
                                     found[0], ordinal if found[1] is None else found[1], rec._step, None))
                if len(deferred) >= 1024:
                    rec._flush()
                rec.seconds += pc() - start
                return out
        raise RuntimeError("slow path not measured")
    return sdpa
WRAPPERS = {"lean-sdpa": make_lean_sdpa, "lean-sdpa-caller": lambda r, o: make_lean_sdpa(r, o, "caller")}
VARIANTS.update({name: (lambda on: None) for name in WRAPPERS})
