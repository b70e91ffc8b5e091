//! Element types: storage in the tensor's dtype, arithmetic in f32.

use half::{bf16, f16};
use std::fmt;

/// The element types tensors can hold (in files: `"f32"`, `"f16"`, `"bf16"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16: f32's exponent range with 8 bits of mantissa.
    BF16,
}

impl DType {
    /// Every dtype, in the order of [`index`](Self::index).
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// The position of this dtype in [`ALL`](Self::ALL): 0 for f32, 1 for f16, 2 for bf16.
    pub const fn index(self) -> usize {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
        }
    }

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Whether this is a 16-bit floating-point type.
    pub const fn is_low_precision(self) -> bool {
        !matches!(self, DType::F32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

/// Runs `$body` with `$T` bound to the element type of `$dtype` (f32, `half::f16` or
/// `half::bf16`): the one place a dtype becomes a type.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::dtype::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::dtype::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;

/// A storable element: converts to and from f32, the type all arithmetic is done in.
pub trait Element: Copy + Send + Sync + Default + PartialEq + fmt::Debug + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
    /// Widens to f32 (exact for every supported type).
    fn to_f32(self) -> f32;
    /// Narrows from f32 with round-to-nearest-even.
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
