//! Elementwise maps: the families that make a new elementwise op a few lines.
//!
//! A unary op with its backward is one entry of the [`unary_op!`] list (in `activation.rs`:
//! the public functions, the host code, the tie to its kernels), one `UNARY_OP` line in
//! `cuda/kernels/elementwise.cu` and one `NAME = unary "name";` line in `cuda/registry.rs`
//! (both kernels); the NVRTC check and the emulation find it through the registry and the
//! list. A binary op is one [`binary_op!`] line plus one `BINARY_OP` line and its registry
//! entry. Arithmetic is in f32 and each result is rounded once to the storage type, on the
//! host and on the GPU alike.

use super::dispatch::{Buffers, Op, Plan, run};
use super::same_layout;
use crate::cpu::elementwise::{map_into, zip_map_into};
use crate::device::Device;
use crate::dtype::{Element, with_dtype};
use crate::error::Result;
use crate::tensor::Tensor;

/// An elementwise function and its gradient, in f32.
pub(crate) trait Unary {
    /// The forward op's name.
    const NAME: &'static str;
    /// The backward op's name.
    const BACKWARD_NAME: &'static str;
    /// The kernels: forward `name(const T* x, T* y, u64 n)` and backward
    /// `name_bwd(const T* x, const T* dy, T* dx, u64 n)`.
    #[cfg(feature = "cuda")]
    const KERNELS: &'static crate::cuda::registry::UnaryKernels;
    /// `f(x)`.
    fn forward(x: f32) -> f32;
    /// The gradient with respect to `x` of `f` at `x` for the upstream gradient `dy`.
    fn backward(x: f32, dy: f32) -> f32;
}

/// `y = f(x)`.
pub(crate) struct UnaryForward<'a, U> {
    x: &'a Tensor,
    op: std::marker::PhantomData<U>,
}

/// Runs the forward of `U` on `x`.
pub(crate) fn unary<U: Unary>(x: &Tensor) -> Result<Tensor> {
    run(UnaryForward::<U> { x, op: std::marker::PhantomData })
}

/// Runs the backward of `U` for the forward input `x` and the upstream `dy`: the binary map
/// [`Gradient<U>`] of `x` and `dy`.
pub(crate) fn unary_backward<U: Unary>(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    binary::<Gradient<U>>(x, dy)
}

impl<U: Unary> Op for UnaryForward<'_, U> {
    const NAME: &'static str = U::NAME;
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.x.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        Ok(Plan::one(self.x.shape(), self.x.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        fn go<T: Element, U: Unary>(x: &Tensor, y: &mut Tensor) -> Result<()> {
            map_into(x.as_slice::<T>()?, y.out_slice::<T>(U::NAME)?, |v| {
                T::from_f32(U::forward(v.to_f32()))
            });
            Ok(())
        }
        with_dtype!(self.x.dtype(), T => go::<T, U>(self.x, bufs.out()))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch};
        let y = bufs.out();
        let n = y.numel();
        // SAFETY: U::KERNELS.forward(const T* x, T* y, u64 n); x and y hold n elements of T.
        unsafe {
            gpu.launch(
                U::KERNELS.forward.of(self.x.dtype()),
                launch::map(n, y.dtype().size_in_bytes()),
                &[ptr(self.x)?, ptr(y)?, Arg::count(n)],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// A unary op's public functions and kernels: what the tests that run every unary op
/// (`cuda/emulated_kernels.rs`) take from [`unary_op!`]'s `UNARY_OPS`.
#[cfg(all(test, feature = "cuda"))]
pub(crate) struct UnaryOpFns {
    /// The forward op's name.
    pub(crate) name: &'static str,
    /// The forward op.
    pub(crate) forward: fn(&Tensor) -> Result<Tensor>,
    /// The backward op.
    pub(crate) backward: fn(&Tensor, &Tensor) -> Result<Tensor>,
    /// Their kernels.
    pub(crate) kernels: &'static crate::cuda::registry::UnaryKernels,
}

/// Declares the unary ops with their backward, one entry each (ending in `;`): the public
/// functions `$fwd` and `$bwd`, and the [`Unary`] impl on the marker type `$ty` that ties
/// them to the registry's kernels `$kernels` (a `NAME = unary "name";` entry) and to the f32
/// functions of `x` (and `dy`). Also lists them all in `UNARY_OPS` for the tests, so an
/// entry is all a new op needs on the Rust side besides its registry line.
macro_rules! unary_op {
    ($(
        $(#[$doc:meta])* $fwd:ident, $(#[$bdoc:meta])* $bwd:ident:
        $ty:ident, $kernels:ident,
        |$x:ident| $f:expr, |$bx:ident, $dy:ident| $b:expr;
    )*) => {
        $(
            /// The marker type of the op.
            pub(crate) struct $ty;

            impl $crate::ops::map::Unary for $ty {
                const NAME: &'static str = stringify!($fwd);
                const BACKWARD_NAME: &'static str = stringify!($bwd);
                #[cfg(feature = "cuda")]
                const KERNELS: &'static $crate::cuda::registry::UnaryKernels =
                    &$crate::cuda::registry::$kernels;
                #[inline(always)]
                fn forward($x: f32) -> f32 {
                    $f
                }
                #[inline(always)]
                fn backward($bx: f32, $dy: f32) -> f32 {
                    $b
                }
            }

            $(#[$doc])*
            ///
            /// # Errors
            ///
            /// [`Error::OutOfMemory`](crate::Error::OutOfMemory).
            pub fn $fwd(x: &Tensor) -> Result<Tensor> {
                $crate::ops::map::unary::<$ty>(x)
            }

            $(#[$bdoc])*
            ///
            /// # Errors
            ///
            /// Shape, dtype and device mismatches between `x` and `dy`; out of memory.
            pub fn $bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
                $crate::ops::map::unary_backward::<$ty>(x, dy)
            }
        )*

        /// Every unary op declared here, for the tests that run them all.
        #[cfg(all(test, feature = "cuda"))]
        pub(crate) const UNARY_OPS: &[$crate::ops::map::UnaryOpFns] = &[$(
            $crate::ops::map::UnaryOpFns {
                name: stringify!($fwd),
                forward: $fwd,
                backward: $bwd,
                kernels: <$ty as $crate::ops::map::Unary>::KERNELS,
            },
        )*];
    };
}
pub(crate) use unary_op;

/// An elementwise function of two tensors of one shape and dtype, in f32.
pub(crate) trait Binary {
    /// The op's name.
    const NAME: &'static str;
    /// The kernel, `name(const T* a, const T* b, T* y, u64 n)`.
    #[cfg(feature = "cuda")]
    const KERNEL: &'static crate::cuda::registry::Kernel;
    /// `f(a, b)`.
    fn apply(a: f32, b: f32) -> f32;
}

/// `y = f(a, b)`.
pub(crate) struct BinaryOp<'a, B> {
    a: &'a Tensor,
    b: &'a Tensor,
    op: std::marker::PhantomData<B>,
}

/// Runs `B` on `a` and `b`.
pub(crate) fn binary<B: Binary>(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    run(BinaryOp::<B> { a, b, op: std::marker::PhantomData })
}

impl<B: Binary> Op for BinaryOp<'_, B> {
    const NAME: &'static str = B::NAME;
    type Outs = Tensor;
    type Output = Tensor;

    fn device(&self) -> &Device {
        self.a.device()
    }

    fn plan(&mut self) -> Result<Plan<Self::Outs>> {
        same_layout(B::NAME, self.a, self.b)?;
        Ok(Plan::one(self.a.shape(), self.a.dtype()))
    }

    fn host(&mut self, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        fn go<T: Element, B: Binary>(a: &Tensor, b: &Tensor, y: &mut Tensor) -> Result<()> {
            let out = y.out_slice::<T>(B::NAME)?;
            zip_map_into(a.as_slice::<T>()?, b.as_slice::<T>()?, out, |x, y| {
                T::from_f32(B::apply(x.to_f32(), y.to_f32()))
            });
            Ok(())
        }
        with_dtype!(self.a.dtype(), T => go::<T, B>(self.a, self.b, bufs.out()))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&mut self, gpu: &crate::cuda::Gpu<'_>, bufs: &mut Buffers<Self::Outs>) -> Result<()> {
        use crate::cuda::{Arg, helpers::ptr, launch};
        let y = bufs.out();
        let n = y.numel();
        // SAFETY: B::KERNEL(const T* a, const T* b, T* y, u64 n); all three hold n elements
        // of T (same layout, checked in `plan`).
        unsafe {
            gpu.launch(
                B::KERNEL.of(self.a.dtype()),
                launch::map(n, y.dtype().size_in_bytes()),
                &[ptr(self.a)?, ptr(self.b)?, ptr(y)?, Arg::count(n)],
            )
        }
    }

    fn finish(self, bufs: Buffers<Self::Outs>) -> Result<Tensor> {
        Ok(bufs.into_output())
    }
}

/// The backward of the unary op `U` as a binary map: `dx = U::backward(x, dy)`, elementwise
/// over the forward input `x` and the upstream `dy` (its kernel takes `x, dy, dx, n` as a
/// binary op's takes `a, b, y, n`).
pub(crate) struct Gradient<U>(std::marker::PhantomData<U>);

impl<U: Unary> Binary for Gradient<U> {
    const NAME: &'static str = U::BACKWARD_NAME;
    #[cfg(feature = "cuda")]
    const KERNEL: &'static crate::cuda::registry::Kernel = &U::KERNELS.backward;
    #[inline(always)]
    fn apply(x: f32, dy: f32) -> f32 {
        U::backward(x, dy)
    }
}

/// Declares a binary op: the public function `$name` and the [`Binary`] impl on the marker
/// type `$ty` that ties it to the kernel `$kernel` and to the f32 function of `a` and `b`.
macro_rules! binary_op {
    ($(#[$doc:meta])* $name:ident: $ty:ident, $kernel:ident, |$a:ident, $b:ident| $f:expr $(,)?) => {
        /// The marker type of the op.
        pub(crate) struct $ty;

        impl $crate::ops::map::Binary for $ty {
            const NAME: &'static str = stringify!($name);
            #[cfg(feature = "cuda")]
            const KERNEL: &'static $crate::cuda::registry::Kernel =
                &$crate::cuda::registry::$kernel;
            #[inline(always)]
            fn apply($a: f32, $b: f32) -> f32 {
                $f
            }
        }

        $(#[$doc])*
        ///
        /// # Errors
        ///
        /// [`Error::ShapeMismatch`](crate::Error::ShapeMismatch),
        /// [`Error::DTypeMismatch`](crate::Error::DTypeMismatch),
        /// [`Error::DeviceMismatch`](crate::Error::DeviceMismatch),
        /// [`Error::OutOfMemory`](crate::Error::OutOfMemory).
        pub fn $name(a: &Tensor, b: &Tensor) -> Result<Tensor> {
            $crate::ops::map::binary::<$ty>(a, b)
        }
    };
}
pub(crate) use binary_op;
