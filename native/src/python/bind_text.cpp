// Python bindings of the text side (issue 31): the WordPiece tokenizer (sakura/tokenizer.hpp)
// and the text encoder's compiled graph (sakura/text_encoder.hpp).
//
//   tokenize(text, vocab_path, max_tokens=16) -> (ids int64 [T], attention_mask int64 [T])
//   Tokenizer(vocab_path): .encode(text, max_tokens=16), .words(text), .pieces(text),
//                          .id(token), .vocab_size
//   TextEncoder(pte_path, vocab_path): .encode(text) -> float32 [T, D], .run(ids, mask),
//                                      .max_tokens, .dim
//   tokenizer_available() / text_encoder_available() -> (bool, why)
//   TokenizerError (a ValueError): a prompt that is not UTF-8, a vocabulary without the
//   special tokens; a missing vocabulary file is FileNotFoundError.
//
// `text` is a str or UTF-8 bytes. Without utf8proc at build time the names exist and say why.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#ifdef SAKURA_HAVE_TEXT
#include "sakura/tokenizer.hpp"
#endif
#ifdef SAKURA_HAVE_TEXT_ENCODER
#include "sakura/text_encoder.hpp"
#endif

namespace py = pybind11;

namespace {

#ifdef SAKURA_HAVE_TEXT

// The bytes of a str (UTF-8) or of a bytes object, kept alive by `holder`.
std::string_view text_bytes(const py::handle& text, py::object& holder) {
  char* ptr = nullptr;
  Py_ssize_t len = 0;
  if (PyUnicode_Check(text.ptr())) {
    // a str with a lone surrogate has no UTF-8 form: say so as the tokenizer's own error
    holder = py::reinterpret_steal<py::object>(
        PyUnicode_AsEncodedString(text.ptr(), "utf-8", "strict"));
    if (!holder) {
      PyErr_Clear();
      throw sakura::TokenizerError("prompt is not valid UTF-8: it has a lone surrogate");
    }
  } else if (PyBytes_Check(text.ptr())) {
    holder = py::reinterpret_borrow<py::object>(text);
  } else {
    throw py::type_error("the prompt must be str or bytes, not " +
                         std::string(py::str(py::type::handle_of(text).attr("__name__"))));
  }
  if (PyBytes_AsStringAndSize(holder.ptr(), &ptr, &len) != 0) throw py::error_already_set();
  return {ptr, static_cast<std::size_t>(len)};
}

py::array_t<std::int64_t> int_array(const std::vector<std::int64_t>& v) {
  py::array_t<std::int64_t> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(std::int64_t));
  return a;
}

py::tuple encode(const sakura::WordPieceTokenizer& tok, const py::handle& text, int max_tokens) {
  py::object holder;
  const std::string_view bytes = text_bytes(text, holder);
  sakura::TokenizedPrompt out;
  {
    py::gil_scoped_release nogil;
    out = tok.encode(bytes, max_tokens);
  }
  return py::make_tuple(int_array(out.ids), int_array(out.mask));
}

std::shared_ptr<sakura::WordPieceTokenizer> load(const std::string& vocab_path) {
  py::gil_scoped_release nogil;
  return std::make_shared<sakura::WordPieceTokenizer>(
      sakura::WordPieceTokenizer::from_file(vocab_path));
}

#ifdef SAKURA_HAVE_TEXT_ENCODER
// One CompiledGraph is not thread-safe: calls are serialised.
struct PyTextEncoder {
  explicit PyTextEncoder(const std::string& pte, const std::string& vocab) {
    py::gil_scoped_release nogil;
    enc = std::make_unique<sakura::TextEncoder>(pte, vocab);
  }
  py::array_t<float> result(const std::vector<float>& v) const {
    py::array_t<float> a({enc->max_tokens(), enc->dim()});
    std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(float));
    return a;
  }
  py::array_t<float> encode(const py::handle& text) {
    py::object holder;
    const std::string_view bytes = text_bytes(text, holder);
    std::vector<float> out;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu);
      out = enc->encode(bytes);
    }
    return result(out);
  }
  py::array_t<float> run(const std::vector<std::int64_t>& ids,
                         const std::vector<std::int64_t>& mask) {
    std::vector<float> out;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu);
      out = enc->run(ids, mask);
    }
    return result(out);
  }
  std::unique_ptr<sakura::TextEncoder> enc;
  std::mutex mu;
};
#endif

#endif  // SAKURA_HAVE_TEXT

}  // namespace

void bind_text(py::module_& m) {
#ifdef SAKURA_HAVE_TEXT
  static py::exception<sakura::TokenizerError> tokenizer_error(m, "TokenizerError",
                                                               PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const sakura::VocabularyNotFound& e) {
      PyErr_SetString(PyExc_FileNotFoundError, e.what());
    } catch (const sakura::TokenizerError& e) {
      py::set_error(tokenizer_error, e.what());
    }
  });
  m.def("tokenizer_available", [] { return py::make_tuple(true, ""); },
        "(True, \"\"), or (False, why): whether this build has the WordPiece tokenizer.");
  m.def("unicode_library", &sakura::unicode_library,
        "The tokenizer's Unicode library: utf8proc's version and its Unicode version.");

  py::class_<sakura::WordPieceTokenizer, std::shared_ptr<sakura::WordPieceTokenizer>>(
      m, "Tokenizer", "BERT basic tokenization + WordPiece over a vocab.txt (the MiniLM "
                      "text encoder's, as dit/text.py calls it).")
      .def(py::init(&load), py::arg("vocab_path"))
      .def("encode", &encode, py::arg("text"), py::arg("max_tokens") = 16,
           "(ids int64 [max_tokens], attention_mask int64 [max_tokens]): [CLS], the first "
           "max_tokens - 2 pieces, [SEP], [PAD]...")
      .def("words", [](const sakura::WordPieceTokenizer& t, const py::handle& text) {
             py::object holder;
             return t.words(text_bytes(text, holder));
           }, py::arg("text"), "The normalized words (before WordPiece).")
      .def("pieces", [](const sakura::WordPieceTokenizer& t, const py::handle& text) {
             py::object holder;
             return t.piece_ids(text_bytes(text, holder));
           }, py::arg("text"), "Every WordPiece id, no special tokens, no truncation.")
      .def("id", &sakura::WordPieceTokenizer::id, py::arg("token"), "The token's id, or -1.")
      .def_property_readonly("vocab_size", &sakura::WordPieceTokenizer::vocab_size);

  m.def("tokenize", [](const py::handle& text, const std::string& vocab_path, int max_tokens) {
          return encode(*load(vocab_path), text, max_tokens);
        }, py::arg("text"), py::arg("vocab_path"), py::arg("max_tokens") = 16,
        "Tokenizer(vocab_path).encode(text, max_tokens): (ids, attention_mask), int64.");

#ifdef SAKURA_HAVE_TEXT_ENCODER
  m.def("text_encoder_available", [] { return py::make_tuple(true, ""); },
        "(True, \"\"), or (False, why): whether this build runs the text encoder's program.");
  py::class_<PyTextEncoder>(m, "TextEncoder",
                            "The text encoder's .pte (ExecuTorch, C++ runtime) behind the "
                            "tokenizer: prompt -> float32 [max_tokens, dim].")
      .def(py::init<const std::string&, const std::string&>(), py::arg("pte_path"),
           py::arg("vocab_path"))
      .def("encode", &PyTextEncoder::encode, py::arg("text"))
      .def("run", &PyTextEncoder::run, py::arg("ids"), py::arg("attention_mask"))
      .def_property_readonly("max_tokens", [](const PyTextEncoder& e) { return e.enc->max_tokens(); })
      .def_property_readonly("dim", [](const PyTextEncoder& e) { return e.enc->dim(); });
#else
  m.def("text_encoder_available", [] {
          return py::make_tuple(false, "sakura_native was built without the edit runtime "
                                       "(edit_runtime_available() says why)");
        }, "(True, \"\"), or (False, why): whether this build runs the text encoder's program.");
#endif
#else
  m.def("tokenizer_available", [] { return py::make_tuple(false, SAKURA_TEXT_UNAVAILABLE); },
        "(True, \"\"), or (False, why): whether this build has the WordPiece tokenizer.");
  m.def("text_encoder_available", [] { return py::make_tuple(false, SAKURA_TEXT_UNAVAILABLE); },
        "(True, \"\"), or (False, why): whether this build runs the text encoder's program.");
#endif
}
