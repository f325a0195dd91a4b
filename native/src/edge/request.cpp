#include "edge/request.hpp"

#include <png.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>

namespace sakura::edge {

std::string base64_decode(const std::string& text, const std::string& what) {
  static const std::string alphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve(text.size() / 4 * 3);
  std::uint32_t acc = 0;
  int bits = 0, pad = 0;
  for (char ch : text) {
    if (ch == '=') {
      ++pad;
      continue;
    }
    if (ch == '\n' || ch == '\r') continue;
    const auto pos = alphabet.find(ch);
    if (pos == std::string::npos || pad) throw InputError(what + " is not base64");
    acc = (acc << 6) | static_cast<std::uint32_t>(pos);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

Image read_png(const std::string& data, int channels, const std::string& what) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, data.data(), data.size())) {
    throw InputError(what + " is not a PNG (" + image.message + ")");
  }
  // alpha is dropped, never composited (PIL's convert("RGB")): read it and skip it
  const bool alpha = (image.format & PNG_FORMAT_FLAG_ALPHA) != 0;
  const bool color = (image.format & PNG_FORMAT_FLAG_COLOR) != 0;
  int read_channels;
  if (channels == 3) {
    image.format = alpha ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB;
    read_channels = alpha ? 4 : 3;
  } else {  // a mask: its gray level, or the first (red) channel of a colour image
    image.format = color ? (alpha ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB)
                         : (alpha ? PNG_FORMAT_GA : PNG_FORMAT_GRAY);
    read_channels = PNG_IMAGE_SAMPLE_CHANNELS(image.format);
  }
  if (image.width == 0 || image.height == 0 || image.width > 8192 || image.height > 8192) {
    png_image_free(&image);
    throw InputError(what + " has an unusable size");
  }
  std::vector<std::uint8_t> buffer(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, buffer.data(), 0, nullptr)) {
    throw InputError(what + " could not be decoded (" + image.message + ")");
  }
  Image out;
  out.width = static_cast<int>(image.width);
  out.height = static_cast<int>(image.height);
  out.channels = channels;
  const std::size_t n = static_cast<std::size_t>(out.width) * out.height;
  out.pixels.resize(n * channels);
  for (std::size_t i = 0; i < n; ++i) {
    for (int c = 0; c < channels; ++c) out.pixels[i * channels + c] = buffer[i * read_channels + c];
  }
  return out;
}

void write_png(const std::string& path, const std::vector<std::uint8_t>& rgb, int width,
               int height) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  image.format = PNG_FORMAT_RGB;
  if (!png_image_write_to_file(&image, path.c_str(), 0, rgb.data(), 0, nullptr)) {
    throw std::runtime_error("cannot write " + path + " (" + image.message + ")");
  }
}

void write_npy(const std::string& path, const std::vector<float>& data,
               const std::vector<std::int64_t>& shape) {
  std::string dims;
  for (auto d : shape) dims += std::to_string(d) + ", ";
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  const std::size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot write " + path);
  const char magic[] = "\x93NUMPY\x01\x00";
  f.write(magic, 8);
  const std::uint16_t len = static_cast<std::uint16_t>(header.size());
  const char lenb[2] = {static_cast<char>(len & 0xFF), static_cast<char>(len >> 8)};
  f.write(lenb, 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(data.data()),
          static_cast<std::streamsize>(data.size() * sizeof(float)));
  if (!f) throw std::runtime_error("cannot write " + path);
}

// ----------------------------------------------------------------------------- noise
namespace {

float uniform24(std::mt19937& gen) {
  return static_cast<float>(static_cast<double>(gen() & ((1u << 24) - 1)) * std::ldexp(1.0, -24));
}

// ATen's normal_fill_16 (mean 0, std 1)
void normal_fill_16(float* d) {
  for (int j = 0; j < 8; ++j) {
    const float u1 = 1.0f - d[j];
    const float u2 = d[j + 8];
    const float radius = std::sqrt(-2.0f * std::log(u1));
    const float theta = 2.0f * static_cast<float>(M_PI) * u2;
    d[j] = radius * std::cos(theta);
    d[j + 8] = radius * std::sin(theta);
  }
}

}  // namespace

std::vector<float> torch_randn(std::int64_t n, std::uint64_t seed) {
  if (n < 16) throw std::invalid_argument("torch_randn: fewer than 16 values");
  std::mt19937 gen(static_cast<std::uint32_t>(seed & 0xFFFFFFFFu));
  std::vector<float> data(static_cast<std::size_t>(n));
  for (auto& v : data) v = uniform24(gen);
  for (std::int64_t i = 0; i + 16 <= n; i += 16) normal_fill_16(data.data() + i);
  if (n % 16 != 0) {
    float* tail = data.data() + n - 16;
    for (int i = 0; i < 16; ++i) tail[i] = uniform24(gen);
    normal_fill_16(tail);
  }
  return data;
}

// ----------------------------------------------------------------------------- tables
const std::vector<float>& Tables::get(const std::string& name,
                                      const std::vector<std::int64_t>& want) const {
  auto it = arrays.find(name);
  if (it == arrays.end()) {
    throw InputError("the bundle's tables have no " + name +
                     " (a bundle made before sakura-edge: rebuild it with `sakura build`)");
  }
  if (!want.empty() && it->second.first != want) {
    std::string got, exp;
    for (auto d : it->second.first) got += std::to_string(d) + " ";
    for (auto d : want) exp += std::to_string(d) + " ";
    throw InputError("the bundle's table " + name + " is [" + got + "], this edit needs [" +
                     exp + "]");
  }
  return it->second.second;
}

const std::vector<std::int64_t>& Tables::shape(const std::string& name) const {
  get(name, {});
  return arrays.at(name).first;
}

Tables read_tables(const std::string& path, const std::map<std::string,
                   std::pair<std::int64_t, std::vector<std::int64_t>>>& index) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw InputError("cannot read the bundle's tables " + path);
  const std::int64_t size = static_cast<std::int64_t>(f.tellg());
  Tables t;
  for (const auto& [name, where] : index) {
    std::int64_t count = 1;
    for (auto d : where.second) count *= d;
    if (where.first < 0 || count < 0 || where.first + count * 4 > size) {
      throw InputError("the bundle's table " + name + " lies outside tables.bin");
    }
    std::vector<float> values(static_cast<std::size_t>(count));
    f.seekg(where.first);
    f.read(reinterpret_cast<char*>(values.data()), count * 4);
    t.arrays[name] = {where.second, std::move(values)};
  }
  return t;
}

// ----------------------------------------------------------------------------- template
TemplateView template_view(const std::string& image_png, const std::string& mask_png,
                           int patch) {
  const Image img = read_png(image_png, 3, "the published template image");
  const Image mask = read_png(mask_png, 1, "the published template mask");
  if (img.width != img.height || mask.width != img.width || mask.height != img.height) {
    throw InputError("the template's image (" + std::to_string(img.width) + "x" +
                     std::to_string(img.height) + ") and mask (" + std::to_string(mask.width) +
                     "x" + std::to_string(mask.height) + ") do not match");
  }
  if (patch <= 0 || img.width % patch != 0) {
    throw InputError("the template's size " + std::to_string(img.width) +
                     " is not a multiple of the bundle's patch " + std::to_string(patch));
  }
  TemplateView tv;
  tv.size = img.width;
  tv.patch = patch;
  tv.grid = img.width / patch;
  const int s = tv.size;
  tv.image.resize(static_cast<std::size_t>(3) * s * s);
  for (int c = 0; c < 3; ++c) {
    for (int y = 0; y < s; ++y) {
      for (int x = 0; x < s; ++x) {
        tv.image[(static_cast<std::size_t>(c) * s + y) * s + x] =
            static_cast<float>(img.pixels[(static_cast<std::size_t>(y) * s + x) * 3 + c]) / 127.5f -
            1.0f;
      }
    }
  }
  for (int gy = 0; gy < tv.grid; ++gy) {
    for (int gx = 0; gx < tv.grid; ++gx) {
      bool editable = false;  // token_mask: any pixel of the patch
      for (int py = 0; py < patch && !editable; ++py) {
        for (int px = 0; px < patch; ++px) {
          if (mask.pixels[static_cast<std::size_t>(gy * patch + py) * s + gx * patch + px] > 127) {
            editable = true;
            break;
          }
        }
      }
      (editable ? tv.masked : tv.unmasked).push_back(gy * tv.grid + gx);
    }
  }
  if (tv.masked.empty()) throw InputError("the template's mask has no editable pixel");
  return tv;
}

std::vector<float> TemplateView::tokens() const {
  const int p = patch, g = grid, pd = patch_dim();
  std::vector<float> out(static_cast<std::size_t>(num_tokens()) * pd);
  for (int gy = 0; gy < g; ++gy) {
    for (int gx = 0; gx < g; ++gx) {
      float* row = out.data() + static_cast<std::size_t>(gy * g + gx) * pd;
      for (int c = 0; c < channels; ++c) {
        for (int py = 0; py < p; ++py) {
          for (int px = 0; px < p; ++px) {
            row[(c * p + py) * p + px] =
                image[(static_cast<std::size_t>(c) * size + gy * p + py) * size + gx * p + px];
          }
        }
      }
    }
  }
  return out;
}

std::vector<float> linear(const std::vector<float>& x, const std::vector<float>& weight,
                          const std::vector<float>& bias, std::int64_t in, std::int64_t out) {
  const std::int64_t rows = static_cast<std::int64_t>(x.size()) / in;
  std::vector<float> y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      float acc = 0.0f;
      const float* a = x.data() + r * in;
      const float* w = weight.data() + o * in;
      for (std::int64_t i = 0; i < in; ++i) acc += a[i] * w[i];
      y[r * out + o] = acc + bias[o];
    }
  }
  return y;
}

EditInputs edit_inputs(const TemplateView& tv, const Tables& tables, std::vector<float> txt,
                       int batch, int txt_tokens, std::uint64_t seed, bool full, bool dynamic) {
  const int steps = tv.steps;
  const std::int64_t n = tv.num_tokens(), pd = tv.patch_dim();
  const auto& sched = tables.get("schedule", {steps + 1});
  const auto& vshape = tables.shape("vec_img");
  if (vshape.size() != 2 || vshape[0] != steps) {
    throw InputError("the bundle's vec_img table does not hold one vector per step");
  }
  const std::int64_t d = vshape[1];
  const auto& vi = tables.get("vec_img", {steps, d});
  const auto& vt = tables.get("vec_txt", {steps, d});
  const auto& half = tables.shape("rope_img_cos");
  if (half.size() != 2 || half[0] != n) {
    throw InputError("the bundle's RoPE tables are not of this template's " +
                     std::to_string(n) + " tokens");
  }
  const std::int64_t h = half[1];
  const auto& icos = tables.get("rope_img_cos", {n, h});
  const auto& isin = tables.get("rope_img_sin", {n, h});
  const auto& tcos = tables.get("rope_txt_cos", {txt_tokens, h});
  const auto& tsin = tables.get("rope_txt_sin", {txt_tokens, h});

  EditInputs in;
  in.steps = steps;
  in.guidance = static_cast<float>(tv.guidance);
  in.txt = std::move(txt);
  for (int s = 0; s < steps; ++s) {
    for (int b = 0; b < batch; ++b) {
      in.vec_txt.insert(in.vec_txt.end(), vt.begin() + s * d, vt.begin() + (s + 1) * d);
      in.vec_img.insert(in.vec_img.end(), vi.begin() + s * d, vi.begin() + (s + 1) * d);
    }
    in.dt.push_back(sched[s + 1] - sched[s]);
  }
  // edit_start: the edit noise (seed + 1_000_003) over the full grid, or with strength < 1
  // the template forward-noised to t = strength with it (renoise, in float32)
  std::vector<float> x = torch_randn(n * pd, seed + 1000003ULL);
  if (tv.strength != 1.0) {
    const auto x0 = tv.tokens();
    const float a = static_cast<float>(1.0 - tv.strength), t = static_cast<float>(tv.strength);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float u = a * x0[i];
      const float v = t * x[i];
      x[i] = u + v;
    }
  }
  std::vector<std::int64_t> rows;
  if (full) {
    for (std::int64_t i = 0; i < n; ++i) rows.push_back(i);
  } else {
    rows = tv.masked;
  }
  if (full) {
    in.x = x;
  } else {
    for (auto r : rows) in.x.insert(in.x.end(), x.begin() + r * pd, x.begin() + (r + 1) * pd);
  }
  if (!dynamic) {
    in.cos.assign(tcos.begin(), tcos.end());
    in.sin.assign(tsin.begin(), tsin.end());
  }
  for (auto r : rows) {
    in.cos.insert(in.cos.end(), icos.begin() + r * h, icos.begin() + (r + 1) * h);
    in.sin.insert(in.sin.end(), isin.begin() + r * h, isin.begin() + (r + 1) * h);
  }
  if (full) {
    if (tv.seed < 0) throw InputError("the template's catalog entry has no seed");
    in.pinned = tv.unmasked;
    in.pin_x0 = tv.tokens();
    in.pin_noise = torch_randn(n * pd, static_cast<std::uint64_t>(tv.seed));
    in.t.assign(sched.begin(), sched.begin() + steps);
  }
  return in;
}

std::vector<float> compose(const TemplateView& tv, const std::vector<float>& x, bool full) {
  auto tokens = tv.tokens();
  const std::int64_t pd = tv.patch_dim();
  for (std::size_t k = 0; k < tv.masked.size(); ++k) {
    const std::int64_t src = full ? tv.masked[k] : static_cast<std::int64_t>(k);
    std::copy(x.begin() + src * pd, x.begin() + (src + 1) * pd,
              tokens.begin() + tv.masked[k] * pd);
  }
  const int p = tv.patch, g = tv.grid, s = tv.size;
  std::vector<float> img(static_cast<std::size_t>(tv.channels) * s * s);
  for (int gy = 0; gy < g; ++gy) {
    for (int gx = 0; gx < g; ++gx) {
      const float* row = tokens.data() + static_cast<std::size_t>(gy * g + gx) * pd;
      for (int c = 0; c < tv.channels; ++c) {
        for (int py = 0; py < p; ++py) {
          for (int px = 0; px < p; ++px) {
            const float v = row[(c * p + py) * p + px];
            img[(static_cast<std::size_t>(c) * s + gy * p + py) * s + gx * p + px] =
                std::min(1.0f, std::max(-1.0f, v));
          }
        }
      }
    }
  }
  return img;
}

std::vector<std::uint8_t> to_rgb8(const std::vector<float>& chw, int size) {
  std::vector<std::uint8_t> out(static_cast<std::size_t>(3) * size * size);
  for (int c = 0; c < 3; ++c) {
    for (int i = 0; i < size * size; ++i) {
      const float v = std::min(1.0f, std::max(-1.0f, chw[static_cast<std::size_t>(c) * size * size + i]));
      const float scaled = (v + 1.0f) * 127.5f;
      out[static_cast<std::size_t>(i) * 3 + c] = static_cast<std::uint8_t>(std::nearbyint(scaled));
    }
  }
  return out;
}

}  // namespace sakura::edge
