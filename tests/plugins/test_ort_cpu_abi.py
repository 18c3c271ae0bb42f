"""ort_abi.h's table of ONNX Runtime C-API slots, checked row by row against the installed runtime: each slot
holds the function its row names (CreateStatus through ctypes; the others called by AbiProbe, a probe op built
here from the kernels' own kernel.h, with inputs whose answers only the named function gives), each row's
version is the one ORT's own table sizes give that slot, and an ORT older than the table needs is refused at
registration with one error line. Every call through a slot runs in a child process: a wrong slot kills the
child (a signal in its return code) and fails the test, never pytest."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from plugins import ort_cpu

SOURCE_DIR = Path(ort_cpu.__file__).resolve().parent
ROW = re.compile(r"^\s*X\((\d+), (\w+), (\d+)\)", re.MULTILINE)

# The last slot of each API version, as ORT's own static_asserts on its table pin them
# (onnxruntime/core/session/onnxruntime_c_api.cc): a function's version is the first whose table reaches it.
LAST_SLOT = {1: 101, 2: 118, 3: 124, 4: 126, 5: 149, 6: 157, 7: 161, 8: 169, 9: 191, 10: 203, 11: 209, 12: 218,
             13: 224, 14: 238, 15: 254, 16: 265, 17: 275, 18: 279, 20: 284, 22: 317, 23: 389, 24: 411}

# What AbiProbe writes into its [4, 5] output, in order.
FIELDS = ("alpha", "k", "x_is_constant", "weight_is_constant", "weight_sum", "weight_dim", "x_rank", "x_dim0",
          "x_dim1", "x_dim2", "x_sum", "z_rank", "z_dim0", "z_sum", "grown_released", "grown_kept",
          "parallel_calls", "parallel_index_sum", "status_grown_released", "status_grown_kept")

PROBE = r"""
// AbiProbe (domain unispec.abi_probe): calls every slot of ort_abi.h through kernel.h, as the kernels do, and
// writes what each call answered into its output, in the order of FIELDS.
#include <malloc.h>
#include <atomic>
#include <string>
#include "kernel.h"

using namespace unispec_cpu;

namespace {

struct Probe {
  float alpha = 0, weight_sum = 0;
  int64_t k = 0, weight_dim = 0;
  int x_is_constant = -1, weight_is_constant = -1;
};

struct Seen {
  std::atomic<int64_t> calls{0}, index_sum{0};
};

OrtStatus* create(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* p = new Probe;
  *kernel = p;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(
      g_api, KernelInfoGetAttribute_float)(info, "alpha", &p->alpha));
  RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(
      g_api, KernelInfoGetAttribute_int64)(info, "k", &p->k));
  auto constant = call<OrtStatus* (*)(const OrtKernelInfo*, size_t, int*, const OrtValue**)>(
      g_api, KernelInfoGetConstantInput_tensor);
  const OrtValue* value = nullptr;
  RETURN_IF_ERROR(constant(info, 0, &p->x_is_constant, &value));
  RETURN_IF_ERROR(constant(info, 1, &p->weight_is_constant, &value));
  Tensor weight;
  RETURN_IF_ERROR(read_tensor(value, &weight));
  p->weight_dim = weight.dims.empty() ? -1 : weight.dims[0];
  for (int64_t i = 0; i < weight.numel(); ++i) p->weight_sum += static_cast<const float*>(weight.data)[i];
  return nullptr;
}

// Bytes the main arena grew by over `rounds` of GetTensorTypeAndShape, each released or kept.
OrtStatus* churn(const OrtValue* value, bool release, float* grown) {
  const double before = static_cast<double>(mallinfo2().uordblks);
  for (int i = 0; i < 64; ++i) {
    OrtTensorTypeAndShapeInfo* info = nullptr;
    RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(
        g_api, GetTensorTypeAndShape)(value, &info));
    if (release) call<void (*)(OrtTensorTypeAndShapeInfo*)>(g_api, ReleaseTensorTypeAndShapeInfo)(info);
  }
  *grown = static_cast<float>(static_cast<double>(mallinfo2().uordblks) - before);
  return nullptr;
}

// Bytes the main arena grew by over 64 error statuses of 4 KB messages from CreateStatus, each released or kept.
float status_churn(bool release) {
  const std::string message(4096, 'x');
  const double before = static_cast<double>(mallinfo2().uordblks);
  for (int i = 0; i < 64; ++i) {
    OrtStatus* status = call<OrtStatus* (*)(int, const char*)>(g_api, CreateStatus)(kFail, message.c_str());
    if (release) call<void (*)(OrtStatus*)>(g_api, ReleaseStatus)(status);
  }
  return static_cast<float>(static_cast<double>(mallinfo2().uordblks) - before);
}

void mark(void* data, size_t i) {
  auto* seen = static_cast<Seen*>(data);
  seen->calls += 1;
  seen->index_sum += static_cast<int64_t>(i) + 1;
}

float dim(const Tensor& t, size_t i) { return i < t.dims.size() ? float(t.dims[i]) : -1.0f; }   // -1: none

float sum(const Tensor& t) {
  float total = 0;
  for (int64_t i = 0; i < t.numel(); ++i) total += static_cast<const float*>(t.data)[i];
  return total;
}

OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  const Probe& p = *static_cast<const Probe*>(kernel);
  Tensor x, z;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  RETURN_IF_ERROR(read_input(context, 2, &z));
  const OrtValue* x_value = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(
      g_api, KernelContext_GetInput)(context, 0, &x_value));
  float grown_released = 0, grown_kept = 0;
  RETURN_IF_ERROR(churn(x_value, true, &grown_released));
  RETURN_IF_ERROR(churn(x_value, false, &grown_kept));
  Seen seen;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
      g_api, KernelContext_ParallelFor)(context, mark, 13, 0, &seen));
  void* data = nullptr;
  const float status_released = status_churn(true), status_kept = status_churn(false);
  RETURN_IF_ERROR(make_output(context, 0, {4, 5}, &data));
  const float answers[20] = {p.alpha, float(p.k), float(p.x_is_constant), float(p.weight_is_constant), p.weight_sum,
                             float(p.weight_dim), float(x.dims.size()), dim(x, 0), dim(x, 1), dim(x, 2), sum(x),
                             float(z.dims.size()), dim(z, 0), sum(z),
                             grown_released, grown_kept, float(seen.calls), float(seen.index_sum),
                             status_released, status_kept};
  for (int i = 0; i < 20; ++i) static_cast<float*>(data)[i] = answers[i];
  return nullptr;
}

OrtCustomOp probe_op() {
  OrtCustomOp op = cpu_op();
  op.GetName = [](const OrtCustomOp*) { return "AbiProbe"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return size_t(3); };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t(1); };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return int(kFloat); };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Probe*>(kernel); };
  return op;
}

OrtCustomOp g_probe = probe_op();

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* base) {
  RETURN_IF_ERROR(bind_api(base));
  OrtCustomOpDomain* domain = nullptr;
  RETURN_IF_ERROR(call<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(g_api, CreateCustomOpDomain)(
      "unispec.abi_probe", &domain));
  RETURN_IF_ERROR(call<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(g_api, CustomOpDomain_Add)(
      domain, &g_probe));
  return call<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(g_api, AddCustomOpDomain)(options, domain);
}
"""

# Runs one check in this child: `status SLOT`, `old_ort LIBRARY NEEDED` or `probe LIBRARY MODEL`; prints JSON.
CHILD = r"""
import ctypes, json, sys
from pathlib import Path
import numpy as np
import onnxruntime as ort

VOID, UINT = ctypes.c_void_p, ctypes.c_uint32

def runtime():
    lib = ctypes.CDLL(str(next((Path(ort.__file__).parent / "capi").glob("libonnxruntime.so*"))))
    lib.OrtGetApiBase.restype = ctypes.POINTER(VOID)
    get = ctypes.CFUNCTYPE(VOID, UINT)(lib.OrtGetApiBase()[0])
    return get, ctypes.cast(get(1), ctypes.POINTER(VOID))

def read(table, made):   # GetErrorCode (slot 1), GetErrorMessage (2): read back what CreateStatus made
    code = ctypes.CFUNCTYPE(ctypes.c_int, VOID)(table[1])(made)
    return [code, ctypes.CFUNCTYPE(ctypes.c_char_p, VOID)(table[2])(made).decode()]

def status(slot):
    _, table = runtime()
    return read(table, ctypes.CFUNCTYPE(VOID, ctypes.c_int, ctypes.c_char_p)(table[int(slot)])(7, b"slot check"))

def old_ort(library, needed):   # an OrtApiBase whose GetApi stops one version short of `needed`
    get, table = runtime()
    version = ctypes.create_string_buffer(b"1.%d.0" % (int(needed) - 1))
    fake_get = ctypes.CFUNCTYPE(VOID, UINT)(lambda v: get(v) if v < int(needed) else None)
    fake_version = ctypes.CFUNCTYPE(VOID)(lambda: ctypes.addressof(version))
    base = (VOID * 2)(ctypes.cast(fake_get, VOID), ctypes.cast(fake_version, VOID))
    register = ctypes.CDLL(library).RegisterCustomOps
    register.restype, register.argtypes = VOID, [VOID, VOID]
    made = register(None, ctypes.addressof(base))
    return None if made is None else read(table, made)

def probe(library, model):
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    x = np.arange(30, dtype=np.float32).reshape(2, 3, 5)
    out = session.run(None, {"x": x, "z": np.full(7, 0.25, np.float32)})[0]
    return {"shape": list(out.shape), "answers": out.ravel().tolist()}

mode, *args = sys.argv[1:]
print(json.dumps({"status": status, "old_ort": old_ort, "probe": probe}[mode](*args)))
"""


def table() -> dict[str, tuple[int, int]]:
    """ort_abi.h's rows: name -> (slot, the API version that added it)."""
    rows = ROW.findall((SOURCE_DIR / "ort_abi.h").read_text())
    return {name: (int(slot), int(since)) for slot, name, since in rows}


class ChildDied(Exception):
    """A check's child process ended without an answer: a signal (a wrong slot) or an error."""


def child(*args: object) -> object:
    """What the child answered to check `args`; ChildDied (failing the calling test) when it died."""
    run = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise ChildDied(f"the {args[0]} check's child ended with {run.returncode}: {run.stderr[-1500:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def probe_model() -> onnx.ModelProto:
    node = helper.make_node("AbiProbe", ["x", "weight", "z"], ["answers"], domain="unispec.abi_probe", alpha=0.375,
                            k=41)
    weight = helper.make_tensor("weight", TensorProto.FLOAT, [4], [0.5, 1.5, 2.5, 3.5])
    graph = helper.make_graph([node], "abi_probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5]),
                                                    helper.make_tensor_value_info("z", TensorProto.FLOAT, [7])],
                              [helper.make_tensor_value_info("answers", TensorProto.FLOAT, [None, None])],
                              initializer=[weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24),
                                                   helper.make_opsetid("unispec.abi_probe", 1)], ir_version=10)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """AbiProbe's answers, from a session in a child process; {"died": message} when the child died."""
    folder = tmp_path_factory.mktemp("abi_probe")
    (folder / "probe.cc").write_text(PROBE)
    cxx = ort_cpu.compiler()
    assert cxx is not None, "the ABI probe needs a C++ compiler (install g++ or set CXX)"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-fvisibility=hidden", f"-I{SOURCE_DIR}",
                    "-o", str(folder / "probe.so"), str(folder / "probe.cc")], check=True)
    onnx.save(probe_model(), folder / "probe.onnx")
    try:
        answered = child("probe", folder / "probe.so", folder / "probe.onnx")
    except ChildDied as died:
        return {"died": str(died)}
    return {"shape": answered["shape"], **dict(zip(FIELDS, answered["answers"]))}


# Per slot, what AbiProbe's answers must be for the slot to hold the function its row names.
CHECKS = {
    # the session finds AbiProbe in domain unispec.abi_probe only if all three did their part
    "CreateCustomOpDomain": lambda a: a["shape"] == [4, 5],
    "CustomOpDomain_Add": lambda a: a["shape"] == [4, 5],
    "AddCustomOpDomain": lambda a: a["shape"] == [4, 5],
    "GetTensorMutableData": lambda a: (a["x_sum"], a["z_sum"], a["weight_sum"]) == (435.0, 1.75, 8.0),
    "GetDimensionsCount": lambda a: (a["x_rank"], a["z_rank"]) == (3.0, 1.0),
    "GetDimensions": lambda a: (a["x_dim0"], a["x_dim1"], a["x_dim2"], a["z_dim0"]) == (2.0, 3.0, 5.0, 7.0),
    "GetTensorTypeAndShape": lambda a: (a["x_dim2"], a["weight_dim"]) == (5.0, 4.0),
    "KernelInfoGetAttribute_float": lambda a: a["alpha"] == 0.375,
    "KernelInfoGetAttribute_int64": lambda a: a["k"] == 41.0,
    "KernelContext_GetInput": lambda a: (a["x_dim0"], a["z_dim0"], a["z_sum"]) == (2.0, 7.0, 1.75),
    "KernelContext_GetOutput": lambda a: a["shape"] == [4, 5],
    # released, 64 infos leave the heap as it was; kept, they grow it (so the measure can see a miss)
    "ReleaseTensorTypeAndShapeInfo": lambda a: a["grown_released"] == 0.0 and a["grown_kept"] > 0.0,
    # released, 64 statuses of 4 KB messages leave the heap as it was; kept, they grow it by their messages
    "ReleaseStatus": lambda a: a["status_grown_released"] == 0.0 and a["status_grown_kept"] >= 64 * 4096,
    "KernelInfoGetConstantInput_tensor": lambda a: (a["weight_is_constant"], a["x_is_constant"],
                                                    a["weight_sum"]) == (1.0, 0.0, 8.0),
    "KernelContext_ParallelFor": lambda a: (a["parallel_calls"], a["parallel_index_sum"]) == (13.0, 91.0),
}


def test_every_row_of_the_table_has_a_check() -> None:
    assert set(table()) == {"CreateStatus", *CHECKS}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_slot_holds_the_function_its_row_names(name: str, probe: dict) -> None:
    assert "died" not in probe, probe.get("died")
    assert CHECKS[name](probe), f"{name} (slot {table()[name][0]}) answered wrongly: {probe}"


def test_create_status_makes_a_status_with_its_code_and_message() -> None:
    assert child("status", table()["CreateStatus"][0]) == [7, "slot check"]


@pytest.mark.parametrize("name", sorted(table()))
def test_each_row_names_the_version_that_added_its_slot(name: str) -> None:
    slot, since = table()[name]
    assert since == min(version for version, last in LAST_SLOT.items() if last >= slot), (name, slot, since)


def test_an_onnx_runtime_older_than_the_table_is_refused_in_one_line() -> None:
    needed = max(since for _, since in table().values())
    code, message = child("old_ort", ort_cpu.library_path(), needed)
    assert code == 1 and message == (f"unispec.cpu needs ONNX Runtime's C API version {needed} (onnxruntime >= "
                                     f"1.{needed}); this onnxruntime is 1.{needed - 1}.0: upgrade onnxruntime")

