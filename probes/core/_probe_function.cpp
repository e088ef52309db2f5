// TensorProbe for eager PyTorch, as a C++ autograd node: the same identity as probes/core/functions.py's
// Python TensorProbe (detached aliases; outputs of inputs that need no gradient are not differentiable;
// gradients that never arrive stay undefined, None in Python), calling the same Python code on forward and
// backward, without the Python Function's per-call machinery (its ctx object, its Python forward/backward).
//
// probe(forward, binding, tensors) -> outputs tuple, or None when a tensor is not exactly torch.Tensor
//   (a subclass's detach() may run its __torch_function__: the caller then uses the Python Function).
//   forward(binding, tensors) runs with grad mode off (as a Function's forward) and returns None, or
//   (backward, token): backward(token, grads) runs on the node's backward.
// Its node is named "TensorProbeBackward" in the autograd graph, as the Python Function's.
#include <torch/extension.h>

#include <type_traits>

namespace {

namespace ag = torch::autograd;

// Whether the interpreter is shutting down: a thread that then asks for the GIL is ended by CPython with
// pthread_exit, whose unwinding through a (noexcept) destructor aborts the process ("terminate called without
// an active exception"). A node freed that late by another thread leaks its references instead.
inline bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// A Python reference freed with the GIL held: the node may be freed on an autograd engine thread.
struct PyRef {
  PyObject* object = nullptr;
  PyRef() = default;
  explicit PyRef(py::handle handle) : object(handle ? handle.inc_ref().ptr() : nullptr) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (object != nullptr && Py_IsInitialized() && !finalizing()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(object);
    }
  }
};

struct TensorProbeBackward : public ag::Node {
  PyRef callback;  // the tracker's backward call
  PyRef token;     // what the forward returned for it (its event)
  // Per input: whether it required grad. With two or more inputs, a gradient reported for one that did not is
  // None (functions.py's ``differentiated``).
  std::vector<bool> required;
  bool mask = false;

  TensorProbeBackward(py::handle callback_, py::handle token_) : callback(callback_), token(token_) {}

  std::string name() const override { return "TensorProbeBackward"; }

  ag::variable_list apply(ag::variable_list&& grads) override {
    if (callback.object != nullptr) {
      py::gil_scoped_acquire gil;
      py::tuple reported(grads.size());
      for (size_t i = 0; i < grads.size(); ++i) {
        if (grads[i].defined() && !(mask && !required[i])) {
          reported[i] = py::cast(grads[i]);
        } else {
          reported[i] = py::none();
        }
      }
      py::handle(callback.object)(py::handle(token.object), reported);
    }
    return std::move(grads);
  }
};

using NodePtr = decltype(ag::Edge::function);

// torch 2.4 holds nodes in a shared_ptr, later versions in an intrusive_ptr (a template: only one branch is built).
// The nodes this one points to free their own successors without recursion (torch's deleter), so a plain
// delete here adds one frame, not a graph's depth.
template <typename Ptr = NodePtr>
Ptr make_node(py::handle callback, py::handle token) {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<ag::Node>>) {
    return Ptr(new TensorProbeBackward(callback, token));
  } else {
    return Ptr(c10::make_intrusive<TensorProbeBackward>(callback, token));
  }
}

py::object probe(py::handle forward, py::handle binding, py::tuple tensors) {
  const size_t count = tensors.size();
  PyTypeObject* plain = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  std::vector<at::Tensor> inputs;
  inputs.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    PyObject* item = PyTuple_GET_ITEM(tensors.ptr(), i);
    if (Py_TYPE(item) != plain) {
      return py::none();
    }
    inputs.push_back(THPVariable_Unpack(item));
  }
  py::object taken;
  std::vector<at::Tensor> outputs;
  outputs.reserve(count);
  {
    at::AutoGradMode no_grad(false);
    at::AutoFwGradMode no_forward_grad(false);
    taken = py::handle(forward)(binding, tensors);
    for (const auto& tensor : inputs) {
      outputs.push_back(tensor.detach());
    }
  }
  bool any = false;
  std::vector<bool> required(count);
  for (size_t i = 0; i < count; ++i) {
    required[i] = inputs[i].requires_grad();
    any = any || required[i];
  }
  if (any && at::GradMode::is_enabled()) {
    py::handle callback, token;  // none: the forward recorded nothing, the backward reports nothing
    if (!taken.is_none()) {
      py::tuple pair = taken.cast<py::tuple>();
      callback = pair[0];
      token = pair[1];
    }
    NodePtr node = make_node(callback, token);
    auto* self = static_cast<TensorProbeBackward*>(node.get());
    self->mask = count >= 2;
    self->required = required;
    node->set_next_edges(ag::collect_next_edges(inputs));
    for (size_t i = 0; i < count; ++i) {
      if (required[i]) {
        const auto input_nr = node->add_input_metadata(outputs[i]);
        ag::impl::set_gradient_edge(outputs[i], {node, input_nr});
      } else {
        node->add_input_metadata(ag::Node::undefined_input());
      }
    }
  }
  py::tuple result(count);
  for (size_t i = 0; i < count; ++i) {
    result[i] = py::cast(std::move(outputs[i]));
  }
  return std::move(result);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("probe", &probe, "TensorProbe's eager identity with Python callbacks (see the file's head)");
}
