// safetensors reading and writing. The reader checks the whole header (types, shapes,
// offsets, overlaps) before it copies a byte of data; the writer lays tensors out in name
// order behind a space-padded header and publishes the file with one rename.
#include "flashdelta/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

namespace flashdelta::io {

// Tensor bytes are copied as stored; that is only right on a little-endian host.
static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this reader assumes a little-endian host");

namespace {

using json = nlohmann::json;

// Real headers are kilobytes; a larger length means a corrupt or hostile file. The same
// limit as the reference implementation (huggingface/safetensors).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// The deepest container a header can hold: root object (0) > entry (1) > shape array (2).
constexpr int kMaxHeaderDepth = 2;

constexpr const char* kMetadataKey = "__metadata__";

constexpr DType kDTypes[] = {DType::f32, DType::f64, DType::bf16,
                             DType::f16, DType::i64, DType::i32};

[[noreturn]] void fail(const std::string& origin, const std::string& problem) {
  throw Error(ErrorCode::invalid_argument, origin.empty() ? problem : origin + ": " + problem);
}

// Text from the file for a message: bytes outside printable ASCII become \xNN, so a hostile
// header cannot put raw or invalid UTF-8 bytes into our messages.
std::string printable(const std::string& text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (const unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

// A name from the file, quoted for a message.
std::string quote_name(const std::string& name) {
  std::string out = "'";  // appended, not `"'" + ...`: GCC 12 misreports -Wrestrict on that
  out += printable(name);
  out += '\'';
  return out;
}

std::optional<DType> dtype_from_name(const std::string& name) {
  for (DType t : kDTypes)
    if (name == safetensors_dtype_name(t)) return t;
  return std::nullopt;
}

std::string unsupported_dtype(const std::string& name) {
  return "unsupported dtype " + quote_name(name) + " (supported: F32, F64, BF16, F16, I64, I32)";
}

std::string tensor_context(const std::string& name) { return "tensor " + quote_name(name) + ": "; }

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

// Number of elements, or nothing when a dimension is negative or when the product of the
// non-zero dimensions times `element_bytes` does not fit int64 (so every stride and byte
// count derived from the shape fits too).
std::optional<int64_t> checked_numel(const std::vector<int64_t>& shape, int64_t element_bytes) {
  int64_t bytes = element_bytes;
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d == 0) {
      empty = true;
    } else if (__builtin_mul_overflow(bytes, d, &bytes)) {
      return std::nullopt;
    }
  }
  return empty ? 0 : bytes / element_bytes;
}

// Rank, sign and size rules shared by the constructor, the reader and the writer; the
// message fragment says what is wrong, or is empty.
std::string shape_problem(const std::vector<int64_t>& shape, DType dtype) {
  if (shape.size() > static_cast<size_t>(kMaxRank))
    return "shape " + shape_string(shape) + " has rank " + std::to_string(shape.size()) +
           ", the maximum rank is " + std::to_string(kMaxRank);
  for (int64_t d : shape)
    if (d < 0) return "shape " + shape_string(shape) + " has a negative dimension";
  if (!checked_numel(shape, dtype_size(dtype)))
    return "shape " + shape_string(shape) + " is too large: its byte size overflows int64";
  return {};
}

// ---------------------------------------------------------------------------------------
// Reading

// Parses the header JSON, rejecting duplicate keys (nlohmann would keep the last one
// silently) and nesting deeper than the format has (which also bounds the work a hostile
// header can cause).
json parse_header_json(const unsigned char* text, size_t size, const std::string& origin) {
  if (size == 0 || text[0] != '{')
    fail(origin, "header must begin with '{' (a JSON object), got " +
                     (size == 0 ? std::string("an empty header")
                                : quote_name(std::string(1, static_cast<char>(text[0])))));
  std::vector<std::set<std::string>> keys_per_object;  // one set per open object
  std::string tensor;                                  // the top-level key being parsed
  auto check = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth > kMaxHeaderDepth)
          fail(origin, "header nests arrays or objects deeper than a safetensors header can (" +
                           tensor_context(tensor) + "at depth " + std::to_string(depth) + ")");
        if (event == json::parse_event_t::object_start) keys_per_object.emplace_back();
        break;
      case json::parse_event_t::object_end: keys_per_object.pop_back(); break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (depth == 1) tensor = key;
        if (!keys_per_object.back().insert(key).second)
          fail(origin, depth == 1 ? "duplicate tensor name " + quote_name(key) + " in the header"
                                  : "duplicate key " + quote_name(key) +
                                        " in the header entry of " + quote_name(tensor));
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return json::parse(text, text + size, check);
  } catch (const json::exception& e) {
    fail(origin, "header is not valid JSON: " + printable(e.what()));
  }
}

// A JSON value for an error message, cut short: the header may be megabytes.
std::string excerpt(const json& j) {
  constexpr size_t kMaxChars = 40;
  std::string text = j.dump();
  if (text.size() > kMaxChars) text = text.substr(0, kMaxChars) + "...";
  return printable(text);
}

// A non-negative JSON integer (floats, negatives and non-numbers are errors naming `what`).
uint64_t read_unsigned(const json& j, const std::string& what, const std::string& origin,
                       const std::string& context) {
  if (!j.is_number_integer())
    fail(origin, context + what + " must be an integer, got " + excerpt(j));
  if (!j.is_number_unsigned()) fail(origin, context + what + " is negative: " + excerpt(j));
  return j.get<uint64_t>();
}

void check_metadata(const json& metadata, const std::string& origin) {
  if (!metadata.is_object())
    fail(origin,
         quote_name(kMetadataKey) + " must be an object of strings, got " + metadata.type_name());
  for (auto it = metadata.begin(); it != metadata.end(); ++it)
    if (!it.value().is_string())
      fail(origin, quote_name(kMetadataKey) + " value of " + quote_name(it.key()) +
                       " must be a string, got " + it.value().type_name());
}

// One tensor's header entry, checked against the size of the data buffer.
struct Entry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

Entry parse_entry(const std::string& name, const json& j, uint64_t data_size,
                  const std::string& origin) {
  const std::string context = tensor_context(name);
  if (!j.is_object()) fail(origin, context + "entry must be an object, got " + j.type_name());
  for (auto it = j.begin(); it != j.end(); ++it)
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets")
      fail(origin, context + "unexpected field " + quote_name(it.key()) +
                       " (an entry has dtype, shape and data_offsets)");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!j.contains(field)) fail(origin, context + "missing field '" + field + "'");

  Entry e;
  e.name = name;
  const json& dtype = j.at("dtype");
  if (!dtype.is_string())
    fail(origin, context + "'dtype' must be a string, got " + dtype.type_name());
  const std::string& dtype_name = dtype.get_ref<const std::string&>();
  const std::optional<DType> parsed = dtype_from_name(dtype_name);
  if (!parsed) fail(origin, context + unsupported_dtype(dtype_name));
  e.dtype = *parsed;

  const json& shape = j.at("shape");
  if (!shape.is_array())
    fail(origin, context + "'shape' must be an array, got " + shape.type_name());
  if (shape.size() > static_cast<size_t>(kMaxRank))
    fail(origin, context + "'shape' has rank " + std::to_string(shape.size()) +
                     ", the maximum rank is " + std::to_string(kMaxRank));
  for (size_t i = 0; i < shape.size(); ++i) {
    const std::string what = "shape[" + std::to_string(i) + "]";
    const uint64_t d = read_unsigned(shape[i], what, origin, context);
    if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(origin, context + what + " = " + std::to_string(d) + " does not fit int64");
    e.shape.push_back(static_cast<int64_t>(d));
  }
  const std::string problem = shape_problem(e.shape, e.dtype);
  if (!problem.empty()) fail(origin, context + problem);

  const json& offsets = j.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2)
    fail(origin, context + "'data_offsets' must be an array [begin, end], got " + excerpt(offsets));
  e.begin = read_unsigned(offsets[0], "data_offsets[0]", origin, context);
  e.end = read_unsigned(offsets[1], "data_offsets[1]", origin, context);
  const std::string range =
      "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "]";
  if (e.begin > e.end) fail(origin, context + range + " must have begin <= end");
  if (e.end > data_size)
    fail(origin, context + range + " reach beyond the data buffer of " + std::to_string(data_size) +
                     " bytes");
  const uint64_t expected =
      static_cast<uint64_t>(*checked_numel(e.shape, dtype_size(e.dtype)) * dtype_size(e.dtype));
  if (e.end - e.begin != expected)
    fail(origin, context + range + " span " + std::to_string(e.end - e.begin) +
                     " bytes, but shape " + shape_string(e.shape) + " of " +
                     safetensors_dtype_name(e.dtype) + " needs " + std::to_string(expected));
  return e;
}

// The tensors must tile the data buffer exactly: no overlaps (two names for the same bytes)
// and no holes (bytes that belong to nothing), as the format requires.
void check_tiling(std::vector<Entry>& entries, uint64_t data_size, const std::string& origin) {
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  auto range = [](const Entry& e) {
    return quote_name(e.name) + " (bytes [" + std::to_string(e.begin) + ", " +
           std::to_string(e.end) + "))";
  };
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry& e : entries) {
    if (e.begin < covered)
      fail(origin, "tensors " + range(*previous) + " and " + range(e) + " overlap");
    if (e.begin > covered)
      fail(origin, "bytes [" + std::to_string(covered) + ", " + std::to_string(e.begin) +
                       ") of the data buffer belong to no tensor (holes are not allowed)");
    covered = e.end;
    previous = &e;
  }
  if (covered != data_size)
    fail(origin, "bytes [" + std::to_string(covered) + ", " + std::to_string(data_size) +
                     ") of the data buffer belong to no tensor (holes are not allowed)");
}

void check_length_field_fits(uint64_t file_size, const std::string& origin) {
  if (file_size < 8)
    fail(origin, "file is " + std::to_string(file_size) +
                     " bytes, shorter than the 8-byte header length field");
}

// The header length field, checked against the size of the whole file (at least 8 bytes).
uint64_t checked_header_size(const unsigned char* length_field, uint64_t file_size,
                             const std::string& origin) {
  uint64_t header_size = 0;
  std::memcpy(&header_size, length_field, 8);  // little-endian host (asserted above)
  if (header_size > kMaxHeaderBytes)
    fail(origin, "header length " + std::to_string(header_size) + " bytes exceeds the limit of " +
                     std::to_string(kMaxHeaderBytes) + " (not a safetensors file, or corrupt)");
  if (header_size > file_size - 8)
    fail(origin, "header length " + std::to_string(header_size) + " bytes is larger than the " +
                     std::to_string(file_size - 8) + " bytes that follow the length field");
  return header_size;
}

// Every tensor a header describes, checked against a data buffer of `data_size` bytes, in
// data order.
std::vector<Entry> parse_header(const unsigned char* text, uint64_t size, uint64_t data_size,
                                const std::string& origin) {
  const json header = parse_header_json(text, size, origin);  // an object
  std::vector<Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == kMetadataKey)
      check_metadata(it.value(), origin);
    else
      entries.push_back(parse_entry(it.key(), it.value(), data_size, origin));
  }
  check_tiling(entries, data_size, origin);
  return entries;
}

// The tensor an entry describes, without its bytes yet.
OwnedTensor tensor_of(Entry& e) {
  OwnedTensor t;
  t.dtype = e.dtype;
  t.shape = std::move(e.shape);
  return t;
}

// ---------------------------------------------------------------------------------------
// Writing

// The current errno as text; call it first thing after the failing call.
std::string system_error() { return std::strerror(errno); }

// The header: sorted names (std::map order, which json objects keep), offsets increasing in
// that order, padded with spaces so the data starts 8-byte aligned.
std::string make_header(const TensorMap& tensors, const std::string& path) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const std::string context = tensor_context(name);
    if (name == kMetadataKey) fail(path, context + "the name is reserved for metadata");
    const std::string problem = shape_problem(t.shape, t.dtype);
    if (!problem.empty()) fail(path, context + problem);
    const uint64_t bytes =
        static_cast<uint64_t>(*checked_numel(t.shape, dtype_size(t.dtype)) * dtype_size(t.dtype));
    if (t.bytes.size() != bytes)
      fail(path, context + "holds " + std::to_string(t.bytes.size()) + " bytes, but shape " +
                     shape_string(t.shape) + " of " + safetensors_dtype_name(t.dtype) + " needs " +
                     std::to_string(bytes));
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {  // a name that is not valid UTF-8
    fail(path, std::string("cannot encode the header: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

// A file descriptor closed on scope exit.
class FileHandle {
 public:
  explicit FileHandle(int fd) : fd_(fd) {}
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;
  ~FileHandle() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now, reporting the error a deferred write may only surface here.
  int close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

void write_all(int fd, const void* data, size_t size, const std::string& temp,
               const std::string& path) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = system_error();
      fail(path, "writing the temporary file '" + temp + "' failed: " + why);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

// Creates a fresh temporary beside `path` (same directory, so the rename is atomic); the
// mode is 0666 filtered by the umask, as for any new file.
std::pair<std::string, int> create_temporary(const std::string& path) {
  static std::atomic<unsigned> counter{0};
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  for (int attempt = 0; attempt < 100; ++attempt) {
    const std::string temp = dir + "." + base + ".tmp-" + std::to_string(::getpid()) + "-" +
                             std::to_string(counter.fetch_add(1));
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) return {temp, fd};
    if (errno != EEXIST) {
      const std::string why = system_error();
      fail(path, "cannot create the temporary file '" + temp + "': " + why);
    }
  }
  fail(path, "cannot create a temporary file beside it: too many name collisions");
}

}  // namespace

// ---------------------------------------------------------------------------------------
// OwnedTensor

OwnedTensor::OwnedTensor(DType dtype_, std::vector<int64_t> shape_)
    : dtype(dtype_), shape(std::move(shape_)) {
  const std::string problem = shape_problem(shape, dtype);
  if (!problem.empty()) throw Error(ErrorCode::invalid_argument, "OwnedTensor: " + problem);
  bytes.assign(static_cast<size_t>(numel() * dtype_size(dtype)), 0);
}

int64_t OwnedTensor::numel() const {
  const std::optional<int64_t> n = checked_numel(shape, dtype_size(dtype));
  if (!n) throw Error(ErrorCode::invalid_argument, "OwnedTensor: " + shape_problem(shape, dtype));
  return *n;
}

TensorView OwnedTensor::view() {
  const std::string problem = shape_problem(shape, dtype);
  if (!problem.empty()) throw Error(ErrorCode::invalid_argument, "OwnedTensor: " + problem);
  if (bytes.size() != static_cast<size_t>(numel() * dtype_size(dtype)))
    throw Error(ErrorCode::invalid_argument,
                "OwnedTensor: holds " + std::to_string(bytes.size()) + " bytes, shape " +
                    shape_string(shape) + " needs " + std::to_string(numel() * dtype_size(dtype)));
  TensorView v;
  v.data = bytes.data();
  v.dtype = dtype;
  v.rank = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.stride[d] = stride;
    stride *= shape[d];
  }
  return v;
}

// ---------------------------------------------------------------------------------------
// Dtype names

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i64: return "I64";
    case DType::i32: return "I32";
  }
  return "?";
}

DType parse_safetensors_dtype(const std::string& name, const std::string& origin) {
  const std::optional<DType> dtype = dtype_from_name(name);
  if (!dtype) fail(origin, unsupported_dtype(name));
  return *dtype;
}

// ---------------------------------------------------------------------------------------
// Reading

TensorMap parse_safetensors(const unsigned char* data, size_t size, const std::string& origin) {
  check_length_field_fits(size, origin);
  const uint64_t header_size = checked_header_size(data, size, origin);
  const unsigned char* buffer = data + 8 + header_size;
  std::vector<Entry> entries = parse_header(data + 8, header_size, size - 8 - header_size, origin);
  TensorMap tensors;
  for (Entry& e : entries) {
    OwnedTensor t = tensor_of(e);
    t.bytes.assign(buffer + e.begin, buffer + e.end);
    tensors.emplace(std::move(e.name), std::move(t));
  }
  return tensors;
}

TensorMap read_safetensors(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const std::string why = system_error();
    fail(path, "cannot open: " + why);
  }
  if (!S_ISREG(st.st_mode)) fail(path, "cannot read: not a regular file");
  const auto file_size = static_cast<uint64_t>(st.st_size);
  check_length_field_fits(file_size, path);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const std::string why = system_error();
    fail(path, "cannot open for reading: " + why);
  }
  auto read_exactly = [&](void* into, uint64_t bytes, const std::string& what) {
    in.read(static_cast<char*>(into), static_cast<std::streamsize>(bytes));
    if (static_cast<uint64_t>(in.gcount()) != bytes)
      fail(path, "the file ended while reading " + what + " (did it change while being read?)");
  };

  // The header first, then each tensor straight into its own bytes: no second copy of the file.
  unsigned char length_field[8];
  read_exactly(length_field, 8, "the header length");
  const uint64_t header_size = checked_header_size(length_field, file_size, path);
  std::vector<unsigned char> header(header_size);
  read_exactly(header.data(), header_size, "the header");
  std::vector<Entry> entries =
      parse_header(header.data(), header_size, file_size - 8 - header_size, path);
  TensorMap tensors;
  for (Entry& e : entries) {  // in offset order, tiling the data: one sequential read
    OwnedTensor t = tensor_of(e);
    t.bytes.resize(e.end - e.begin);
    read_exactly(t.bytes.data(), t.bytes.size(), "tensor " + quote_name(e.name));
    tensors.emplace(std::move(e.name), std::move(t));
  }
  return tensors;
}

// ---------------------------------------------------------------------------------------
// Writing

void write_safetensors(const std::string& path, const TensorMap& tensors) {
  // Everything that can be checked is checked before the file system is touched.
  const std::string header = make_header(tensors, path);
  const uint64_t header_size = header.size();

  auto [temp, fd] = create_temporary(path);
  FileHandle file(fd);
  try {
    unsigned char length[8];
    std::memcpy(length, &header_size, 8);  // little-endian host
    write_all(file.get(), length, 8, temp, path);
    write_all(file.get(), header.data(), header.size(), temp, path);
    for (const auto& [name, t] : tensors)
      write_all(file.get(), t.bytes.data(), t.bytes.size(), temp, path);
    if (::fsync(file.get()) != 0) {
      const std::string why = system_error();
      fail(path, "flushing the temporary file '" + temp + "' failed: " + why);
    }
    if (file.close() != 0) {
      const std::string why = system_error();
      fail(path, "closing the temporary file '" + temp + "' failed: " + why);
    }
    if (::rename(temp.c_str(), path.c_str()) != 0) {
      const std::string why = system_error();
      fail(path, "cannot move the temporary file '" + temp + "' into place: " + why);
    }
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
}

}  // namespace flashdelta::io
