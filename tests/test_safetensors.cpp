// The safetensors reader and writer: round trips of every dtype and rank, files written
// byte by byte from the format description (so the code is not only checked against
// itself), every malformed header, and the atomic write.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/tensor_io.h"
#include "flashdelta/safetensors.h"

namespace flashdelta::io {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::bf16,
                                DType::f16, DType::i64, DType::i32};

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "flashdelta-st-XXXXXX").string();
    EXPECT_NE(::mkdtemp(pattern.data()), nullptr) << "mkdtemp " << pattern;
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ignored);
    fs::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

std::vector<std::string> directory_listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

// A file image: the header length as 8 little-endian bytes, written out byte by byte so
// the test does not rely on the host order, then the header text and the data.
Bytes file_image(uint64_t header_length, const std::string& header, const Bytes& data) {
  Bytes image;
  for (int i = 0; i < 8; ++i) image.push_back(static_cast<unsigned char>(header_length >> (8 * i)));
  image.insert(image.end(), header.begin(), header.end());
  image.insert(image.end(), data.begin(), data.end());
  return image;
}
Bytes file_image(const std::string& header, const Bytes& data) {
  return file_image(header.size(), header, data);
}

OwnedTensor random_tensor(std::mt19937_64& rng, DType dtype, std::vector<int64_t> shape) {
  OwnedTensor t(dtype, std::move(shape));
  std::uniform_int_distribution<int> byte(0, 255);
  for (unsigned char& b : t.bytes) b = static_cast<unsigned char>(byte(rng));
  return t;
}

void expect_same_tensors(const TensorMap& got, const TensorMap& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    const auto it = got.find(name);
    ASSERT_NE(it, got.end()) << "missing tensor " << name;
    EXPECT_EQ(it->second.dtype, w.dtype) << name;
    EXPECT_EQ(it->second.shape, w.shape) << name;
    EXPECT_EQ(it->second.bytes, w.bytes) << name;
  }
}

// Runs f, which must throw Error(invalid_argument) with every fragment in its message;
// returns the message.
template <class F>
std::string expect_error(F&& f, std::initializer_list<const char*> fragments) {
  try {
    f();
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << message;
    for (const char* fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "expected '" << fragment << "' in: " << message;
    return message;
  }
  ADD_FAILURE() << "no error; expected a message with '" << *fragments.begin() << "'";
  return {};
}

// Parsing `image` must fail, and the message must start with the name of the file.
void expect_parse_error(const Bytes& image, std::initializer_list<const char*> fragments) {
  const std::string message = expect_error(
      [&] { parse_safetensors(image.data(), image.size(), "bad.safetensors"); }, fragments);
  if (!message.empty()) {
    EXPECT_EQ(message.rfind("bad.safetensors: ", 0), 0u)
        << "message does not start with the origin: " << message;
  }
}

void expect_header_error(const std::string& header, const Bytes& data,
                         std::initializer_list<const char*> fragments) {
  SCOPED_TRACE("header " + header);
  expect_parse_error(file_image(header, data), fragments);
}

// ---------------------------------------------------------------------------------------
// Round trips

TEST(Safetensors, RoundTripEveryDTypeAndRank) {
  TempDir dir;
  for (uint64_t seed : {1, 2, 3}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int64_t> dim(0, 4);  // zero-size dimensions included
    TensorMap tensors;
    for (DType dtype : kAllDTypes)
      for (int rank = 0; rank <= kMaxRank; ++rank) {
        std::vector<int64_t> shape;
        for (int d = 0; d < rank; ++d) shape.push_back(dim(rng));
        const std::string name =
            std::string(safetensors_dtype_name(dtype)) + ".rank" + std::to_string(rank);
        tensors[name] = random_tensor(rng, dtype, shape);
      }
    tensors["empty.z"] = OwnedTensor(DType::f32, {3, 0, 2});  // always one zero-size tensor
    const std::string path = dir.file("round_trip.safetensors");
    write_safetensors(path, tensors);
    expect_same_tensors(read_safetensors(path), tensors);
    const Bytes image = read_bytes(path);
    expect_same_tensors(parse_safetensors(image.data(), image.size(), "memory"), tensors);
  }
  EXPECT_EQ(directory_listing(dir.path()), std::vector<std::string>{"round_trip.safetensors"})
      << "the temporary file was left behind";
}

TEST(Safetensors, EmptyMapRoundTrips) {
  TempDir dir;
  const std::string path = dir.file("empty.safetensors");
  write_safetensors(path, {});
  // "{}" padded with six spaces to 8 bytes.
  EXPECT_EQ(read_bytes(path), file_image("{}      ", {}));
  EXPECT_TRUE(read_safetensors(path).empty());
}

TEST(Safetensors, WrittenHeaderIsSortedAlignedAndInOrder) {
  TempDir dir;
  std::mt19937_64 rng(7);
  TensorMap tensors;
  tensors["zeta"] = random_tensor(rng, DType::bf16, {3, 5});
  tensors["alpha"] = random_tensor(rng, DType::f64, {7});
  tensors["mid"] = random_tensor(rng, DType::i32, {2, 0});
  tensors["beta"] = random_tensor(rng, DType::f16, {});
  const std::string path = dir.file("layout.safetensors");
  write_safetensors(path, tensors);
  const Bytes image = read_bytes(path);
  ASSERT_GE(image.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(image[i]) << (8 * i);
  EXPECT_EQ(n % 8, 0u) << "header length " << n << " leaves the data unaligned";
  ASSERT_LE(8 + n, image.size());
  const std::string text(image.begin() + 8, image.begin() + 8 + static_cast<int64_t>(n));
  const size_t json_end = text.find_last_not_of(' ');
  ASSERT_NE(json_end, std::string::npos);
  EXPECT_EQ(text[json_end], '}') << "the header is padded with something other than spaces";
  EXPECT_LT(text.size() - json_end - 1, 8u) << "more padding than alignment needs";

  // Names appear sorted, and their data follows one another in that order.
  size_t previous_position = 0;
  uint64_t expected_begin = 0;
  const nlohmann::json header = nlohmann::json::parse(text);
  for (const std::string name : {"alpha", "beta", "mid", "zeta"}) {
    const size_t position = text.find("\"" + name + "\"");
    ASSERT_NE(position, std::string::npos) << name;
    EXPECT_GT(position, previous_position) << name << " is out of order in " << text;
    previous_position = position;
    const auto& offsets = header.at(name).at("data_offsets");
    EXPECT_EQ(offsets[0].get<uint64_t>(), expected_begin) << name;
    expected_begin = offsets[1].get<uint64_t>();
  }
  EXPECT_EQ(8 + n + expected_begin, image.size());
}

// ---------------------------------------------------------------------------------------
// Files written by hand from the format description

TEST(Safetensors, WriterOutputMatchesTheFormatByteForByte) {
  TempDir dir;
  OwnedTensor x(DType::f32, {2});
  const Bytes data = {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40};  // 1.0f, 2.0f
  x.bytes = data;
  const std::string path = dir.file("x.safetensors");
  write_safetensors(path, {{"x", x}});
  // 54 bytes of JSON + 2 spaces = 56 = 0x38.
  const std::string header = R"({"x":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}})"
                             "  ";
  Bytes expected = {0x38, 0, 0, 0, 0, 0, 0, 0};
  expected.insert(expected.end(), header.begin(), header.end());
  expected.insert(expected.end(), data.begin(), data.end());
  EXPECT_EQ(read_bytes(path), expected);
}

TEST(Safetensors, ReadsAHandWrittenFile) {
  // Names out of order, data laid out in another order still, metadata, trailing spaces.
  const std::string header = R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[16,20]},)"
                             R"("__metadata__":{"format":"pt","note":"hand made"},)"
                             R"("a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[20,24]},)"
                             R"("i":{"dtype":"I64","shape":[1],"data_offsets":[8,16]},)"
                             R"("s":{"dtype":"F64","shape":[],"data_offsets":[24,32]},)"
                             R"("j":{"dtype":"I32","shape":[1],"data_offsets":[32,36]},)"
                             R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[36,36]}}   )";
  const Bytes data = {
      0x00, 0x00, 0xc0, 0x3f, 0x00, 0x00, 0x00, 0xc0,  // a: 1.5f, -2.0f
      0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,  // i: -3
      0x00, 0x3c, 0xff, 0x7b,                          // w: 1.0, 65504 (f16)
      0x80, 0x3f, 0x00, 0xbf,                          // b: 1.0, -0.5 (bf16)
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x24, 0x40,  // s: 10.0
      0x07, 0x00, 0x00, 0x80,                          // j: INT32_MIN + 7
  };
  const Bytes image = file_image(header, data);
  TensorMap t = parse_safetensors(image.data(), image.size(), "hand.safetensors");
  ASSERT_EQ(t.size(), 7u);

  auto values = [&](const std::string& name) {
    TensorView v = t.at(name).view();
    std::vector<double> out(static_cast<size_t>(v.numel()));
    detail::load_row(v, 0, v.numel(), 1, out.data());
    return out;
  };
  EXPECT_EQ(t.at("a").dtype, DType::f32);
  EXPECT_EQ(t.at("a").shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(values("a"), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(t.at("i").dtype, DType::i64);
  EXPECT_EQ(values("i"), (std::vector<double>{-3.0}));
  EXPECT_EQ(t.at("w").dtype, DType::f16);
  EXPECT_EQ(values("w"), (std::vector<double>{1.0, 65504.0}));
  EXPECT_EQ(t.at("b").dtype, DType::bf16);
  EXPECT_EQ(values("b"), (std::vector<double>{1.0, -0.5}));
  EXPECT_EQ(t.at("s").dtype, DType::f64);
  EXPECT_TRUE(t.at("s").shape.empty());
  EXPECT_EQ(values("s"), (std::vector<double>{10.0}));
  EXPECT_EQ(t.at("j").dtype, DType::i32);
  EXPECT_EQ(values("j"), (std::vector<double>{-2147483648.0 + 7}));
  EXPECT_EQ(t.at("e").shape, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(t.at("e").bytes.empty());
  EXPECT_EQ(t.count("__metadata__"), 0u) << "metadata is not a tensor";
}

TEST(Safetensors, ViewIsContiguousRowMajor) {
  OwnedTensor t(DType::bf16, {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.bytes.size(), 48u);
  for (unsigned char b : t.bytes) EXPECT_EQ(b, 0) << "not zero-filled";
  const TensorView v = t.view();
  EXPECT_EQ(v.data, t.bytes.data());
  EXPECT_EQ(v.dtype, DType::bf16);
  EXPECT_EQ(v.rank, 3);
  EXPECT_EQ(v.shape[0], 2);
  EXPECT_EQ(v.shape[2], 4);
  EXPECT_EQ(v.stride[0], 12);
  EXPECT_EQ(v.stride[1], 4);
  EXPECT_EQ(v.stride[2], 1);
  expect_error([] { OwnedTensor(DType::f32, {1, 1, 1, 1, 1}); }, {"rank 5", "maximum rank is 4"});
  expect_error([] { OwnedTensor(DType::f32, {2, -1}); }, {"negative"});
}

// ---------------------------------------------------------------------------------------
// Malformed files

TEST(SafetensorsMalformed, MissingOrUnreadableFile) {
  TempDir dir;
  const std::string missing = dir.file("missing.safetensors");
  expect_error([&] { read_safetensors(missing); }, {"missing.safetensors", "No such file"});
  expect_error([&] { read_safetensors(dir.path().string()); }, {"not a regular file"});
}

TEST(SafetensorsMalformed, ReadNamesTheFile) {
  TempDir dir;
  const std::string path = dir.file("short.safetensors");
  write_bytes(path, {1, 2, 3});
  expect_error([&] { read_safetensors(path); }, {"short.safetensors: ", "shorter than the 8-byte"});
  // The reader checks the length field and the header before it reads any tensor data.
  write_bytes(path, file_image(64, "{}", {}));
  expect_error([&] { read_safetensors(path); }, {"short.safetensors: ", "header length 64"});
  write_bytes(path,
              file_image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", Bytes(4)));
  expect_error([&] { read_safetensors(path); },
               {"tensor 'a'", "reach beyond the data buffer of 4"});
}

TEST(SafetensorsMalformed, TooShortForTheLength) {
  expect_parse_error({}, {"file is 0 bytes", "shorter than the 8-byte"});
  expect_parse_error({0x10, 0, 0, 0, 0, 0, 0}, {"file is 7 bytes"});
}

TEST(SafetensorsMalformed, HeaderLengthBeyondTheFile) {
  expect_parse_error(file_image(100, "{}", {}), {"header length 100", "larger than the 2 bytes"});
  expect_parse_error(file_image(uint64_t{1} << 62, "{}", {}), {"exceeds the limit"});
  expect_parse_error(file_image(~uint64_t{0}, "{}", {}), {"exceeds the limit"});
}

TEST(SafetensorsMalformed, HeaderNotJsonOrNotAnObject) {
  expect_header_error("", {}, {"must begin with '{'", "empty header"});
  expect_header_error("[1, 2]", {}, {"must begin with '{'", "JSON object"});
  expect_header_error(" {}", {}, {"must begin with '{'"});
  expect_header_error(R"({"a":)", {}, {"not valid JSON"});
  expect_header_error(R"({"a":1} x)", {}, {"not valid JSON"});
  expect_header_error("{\"\xff\":{}}", {}, {"not valid JSON", "UTF-8"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})", Bytes(4),
                      {"not valid JSON"});
}

TEST(SafetensorsMalformed, EntryNotAnObject) {
  expect_header_error(R"({"a":3})", {}, {"tensor 'a'", "entry must be an object", "number"});
  expect_header_error(R"({"a":[0,4]})", {}, {"tensor 'a'", "entry must be an object", "array"});
}

TEST(SafetensorsMalformed, MissingOrWronglyTypedFields) {
  const Bytes four(4);
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1]}})", four,
                      {"tensor 'a'", "missing field 'data_offsets'"});
  expect_header_error(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", four,
                      {"missing field 'dtype'"});
  expect_header_error(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", four,
                      {"missing field 'shape'"});
  expect_header_error(R"({"a":{"dtype":5,"shape":[1],"data_offsets":[0,4]}})", four,
                      {"'dtype' must be a string"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", four,
                      {"'shape' must be an array"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})", four,
                      {"shape[0] must be an integer"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", four,
                      {"nests"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", four,
                      {"'data_offsets' must be an array [begin, end]"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":{"0":4}}})", four,
                      {"'data_offsets' must be an array [begin, end]"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":["0",4]}})", four,
                      {"data_offsets[0] must be an integer"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,-4]}})", four,
                      {"data_offsets[1] is negative"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"offsets":[]}})",
                      four, {"unexpected field 'offsets'"});
}

TEST(SafetensorsMalformed, UnknownDType) {
  expect_header_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", Bytes(4),
                      {"tensor 'a'", "unsupported dtype 'U8'", "F32, F64, BF16, F16, I64, I32"});
  expect_header_error(R"({"a":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", Bytes(4),
                      {"unsupported dtype 'f32'"});
  expect_error([] { parse_safetensors_dtype("BOOL", "cli"); }, {"cli: ", "unsupported dtype"});
  for (DType t : kAllDTypes) EXPECT_EQ(parse_safetensors_dtype(safetensors_dtype_name(t), ""), t);
}

TEST(SafetensorsMalformed, BadShapes) {
  expect_header_error(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", {},
                      {"shape[0] is negative"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1],"data_offsets":[0,4]}})", Bytes(4),
                      {"rank 5", "the maximum rank is 4"});
  // 2^62 * 4 elements overflow int64 (and so would their byte count).
  expect_header_error(
      R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", {},
      {"too large", "overflows"});
  // Even with a zero dimension, the other dimensions must not overflow.
  expect_header_error(
      R"({"a":{"dtype":"I64","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})", {},
      {"too large"});
  expect_header_error(
      R"({"a":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,0]}})", {},
      {"shape[0] = 18446744073709551615 does not fit int64"});
}

TEST(SafetensorsMalformed, BadDataOffsets) {
  const Bytes eight(8);
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", eight,
                      {"data_offsets [8, 4] must have begin <= end"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", eight,
                      {"data_offsets [4, 12] reach beyond the data buffer of 8 bytes"});
  expect_header_error(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}})", eight,
      {"reach beyond the data buffer"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight,
                      {"span 8 bytes", "shape [3] of F32 needs 12"});
  expect_header_error(R"({"a":{"dtype":"F64","shape":[0],"data_offsets":[0,8]}})", eight,
                      {"span 8 bytes", "needs 0"});
}

TEST(SafetensorsMalformed, OverlapsAndHoles) {
  expect_header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                      Bytes(12), {"tensors 'a' (bytes [0, 8)) and 'b' (bytes [4, 12)) overlap"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                      Bytes(8), {"overlap"});
  // An empty tensor inside another's bytes is two claims on one place too.
  expect_header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                      Bytes(8), {"overlap"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                      Bytes(12), {"bytes [4, 8) of the data buffer belong to no tensor"});
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", Bytes(6),
                      {"bytes [4, 6) of the data buffer belong to no tensor"});
  expect_header_error(R"({})", Bytes(1), {"bytes [0, 1)", "belong to no tensor"});
}

TEST(SafetensorsMalformed, DuplicateNamesAndKeys) {
  expect_header_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                      Bytes(8), {"duplicate tensor name 'a'"});
  expect_header_error(R"({"a":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}})",
                      Bytes(4), {"duplicate key 'dtype'", "'a'"});
  expect_header_error(R"({"__metadata__":{"k":"1","k":"2"}})", {}, {"duplicate key 'k'"});
}

TEST(SafetensorsMalformed, BadMetadata) {
  expect_header_error(R"({"__metadata__":["x"]})", {},
                      {"'__metadata__' must be an object of strings", "array"});
  expect_header_error(R"({"__metadata__":{"epoch":3}})", {},
                      {"'__metadata__' value of 'epoch' must be a string", "number"});
  expect_header_error(R"({"__metadata__":{"a":{"b":"c"}}})", {}, {"must be a string"});
}

TEST(SafetensorsMalformed, DeepNestingIsRejectedEarly) {
  // A hostile header nests far deeper than any valid one.
  const std::string deep = R"({"a":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  expect_header_error(deep, {}, {"nests arrays or objects deeper", "tensor 'a'"});
}

// ---------------------------------------------------------------------------------------
// Writing

TensorMap small_map(uint64_t seed) {
  std::mt19937_64 rng(seed);
  TensorMap tensors;
  tensors["q"] = random_tensor(rng, DType::f32, {2, 3, 4});
  tensors["cu"] = random_tensor(rng, DType::i64, {3});
  return tensors;
}

TEST(SafetensorsWrite, ReplacesAnExistingFile) {
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  write_safetensors(path, small_map(1));
  const TensorMap second = small_map(2);
  write_safetensors(path, second);
  expect_same_tensors(read_safetensors(path), second);
  EXPECT_EQ(directory_listing(dir.path()), std::vector<std::string>{"out.safetensors"});
}

TEST(SafetensorsWrite, MissingDirectoryIsNamed) {
  TempDir dir;
  const std::string path = dir.file("no/such/dir/out.safetensors");
  expect_error([&] { write_safetensors(path, small_map(1)); },
               {"out.safetensors", "cannot create the temporary file", "No such file"});
  EXPECT_TRUE(directory_listing(dir.path()).empty());
}

TEST(SafetensorsWrite, InvalidTensorLeavesThePreviousFileIntact) {
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  write_safetensors(path, small_map(1));
  const Bytes before = read_bytes(path);

  TensorMap short_bytes = small_map(2);
  short_bytes["q"].bytes.pop_back();
  expect_error([&] { write_safetensors(path, short_bytes); },
               {"out.safetensors", "tensor 'q'", "holds 95 bytes", "needs 96"});
  TensorMap rank5 = small_map(2);
  rank5["r"].shape = {1, 1, 1, 1, 1};
  rank5["r"].bytes.resize(4);
  expect_error([&] { write_safetensors(path, rank5); }, {"tensor 'r'", "maximum rank is 4"});
  TensorMap negative = small_map(2);
  negative["n"].shape = {-2};
  expect_error([&] { write_safetensors(path, negative); }, {"tensor 'n'", "negative"});
  TensorMap reserved = small_map(2);
  reserved["__metadata__"] = OwnedTensor(DType::f32, {1});
  expect_error([&] { write_safetensors(path, reserved); }, {"reserved"});
  TensorMap bad_name = small_map(2);
  bad_name["\xff"] = OwnedTensor(DType::f32, {1});
  expect_error([&] { write_safetensors(path, bad_name); }, {"cannot encode the header", "UTF-8"});

  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(directory_listing(dir.path()), std::vector<std::string>{"out.safetensors"});
}

// The kernel stops the write half way (file size limit): the temporary is half written, the
// target must still hold the previous file, and the temporary must be gone.
TEST(SafetensorsWrite, FailedWriteLeavesThePreviousFileIntact) {
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  write_safetensors(path, small_map(1));
  const Bytes before = read_bytes(path);

  TensorMap big;
  big["big"] = OwnedTensor(DType::f64, {64, 1024});  // 512 KiB
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit limited = saved;
  limited.rlim_cur = 64 * 1024;
  const auto saved_handler = ::signal(SIGXFSZ, SIG_IGN);  // fail the write with EFBIG instead
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  std::string message;
  try {
    write_safetensors(path, big);
  } catch (const Error& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, saved_handler);

  EXPECT_NE(message.find("out.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("writing the temporary file"), std::string::npos) << message;
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(directory_listing(dir.path()), std::vector<std::string>{"out.safetensors"});
}

TEST(SafetensorsWrite, FailedRenameLeavesNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("taken");
  fs::create_directory(path);
  write_bytes(dir.file("taken/keep"), {1, 2, 3});
  expect_error([&] { write_safetensors(path, small_map(1)); },
               {"taken", "cannot move the temporary file"});
  EXPECT_EQ(directory_listing(dir.path()), std::vector<std::string>{"taken"});
  EXPECT_EQ(read_bytes(dir.file("taken/keep")), (Bytes{1, 2, 3}));
}

TEST(SafetensorsWrite, UnwritableDirectoryLeavesThePreviousFileIntact) {
  if (::geteuid() == 0)
    GTEST_SKIP() << "root ignores directory permissions; FailedWriteLeavesThePreviousFileIntact "
                    "covers a failing write";
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  write_safetensors(path, small_map(1));
  const Bytes before = read_bytes(path);
  fs::permissions(dir.path(), fs::perms::owner_read | fs::perms::owner_exec);
  expect_error([&] { write_safetensors(path, small_map(2)); },
               {"out.safetensors", "cannot create the temporary file", "Permission denied"});
  fs::permissions(dir.path(), fs::perms::owner_all);
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(directory_listing(dir.path()), std::vector<std::string>{"out.safetensors"});
}

}  // namespace
}  // namespace flashdelta::io
