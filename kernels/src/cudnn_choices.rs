//! The cuDNN choices a GPU made, for a virtual device to replay.
//!
//! A CUDA device caches, per convolution shape and direction, the algorithm cuDNN ran and the
//! workspace it took from the caching allocator (PyTorch's `BenchmarkCache`; see
//! [`Device::cudnn_choices`]). Those workspaces are what a virtual device cannot know by
//! itself: only cuDNN on a GPU can size them. Given a GPU's record
//! ([`Device::set_cudnn_choices`]), a virtual device runs its convolutions as that GPU's
//! cuDNN does: no own-kernel workspaces (im2col buffers and alike), channels_last tensors
//! read as they are (no permutes), each call's workspace allocated and freed at the size the
//! GPU's choice took, and its batch norms through cuDNN where PyTorch's rule sends them
//! there. So `plan` and the twin predict a cuDNN GPU's peaks, for the shapes the record
//! holds.
//!
//! A call the record does not hold (another batch size, another model) is counted as a miss
//! ([`Device::cudnn_choice_misses`]) and takes no workspace: a prediction with misses is a
//! lower bound by those workspaces. Batch norm through cuDNN is recorded per call too (its
//! workspace and, in training, reserve space: [`BnChoice`]); a batch norm the record lacks
//! takes none. A choice found by a timed search (`cudnn_benchmark`) also records the
//! workspace that search ran in ([`ConvChoice::search_workspace`]); a virtual device with
//! `cudnn_benchmark` on allocates and frees it at a shape's first call, as the GPU did (a
//! benchmark run replaying a record made without searches counts each first call as a miss).
//!
//! [`Device::cudnn_choices`]: crate::Device::cudnn_choices
//! [`Device::set_cudnn_choices`]: crate::Device::set_cudnn_choices
//! [`Device::cudnn_choice_misses`]: crate::Device::cudnn_choice_misses

use crate::dtype::DType;
use crate::params::{Conv2dParams, ConvLayout};
use serde::{Deserialize, Serialize};

/// Whether cuDNN can run convolution `p`: nonempty, and every tensor's element count within
/// `i32::MAX` (PyTorch splits the batch in that case; vram runs its own kernels instead).
pub(crate) fn supports(p: &Conv2dParams) -> bool {
    let fits = |n: usize| i32::try_from(n).is_ok();
    p.output_len() > 0
        && p.input_len() > 0
        && p.weight_len() > 0
        && fits(p.input_len())
        && fits(p.output_len())
        && fits(p.weight_len())
}

/// Whether PyTorch runs convolution `p` of `dtype` in `layout` through cuDNN (given cuDNN is
/// loaded and enabled) on a GPU of compute capability `major`.x: `select_conv_backend`'s
/// `use_cudnn_depthwise` for a depthwise convolution and `use_cudnn` for the others
/// (`aten/src/ATen/native/Convolution.cpp`), as far as vram's 2-d convolutions meet them:
///
/// - a depthwise convolution (`groups == c_in > 1`, `c_out` a multiple of `c_in`) runs cuDNN
///   channels_last always; NCHW only in f16 with at least 32 channels, no dilation, equal
///   strides (or a height of 1) and a workload `check_cudnn_depthwise_workload_with_filter`
///   accepts; elsewhere PyTorch's own depthwise kernel (`conv_depthwise2d`), as vram's own
///   kernels here;
/// - bf16 runs cuDNN only from compute capability 8 (`supportsBFloat16ConvolutionWithCuDNNv8`);
/// - and [`supports`]: vram runs its own kernels where PyTorch would split the batch.
pub(crate) fn pytorch_uses_cudnn(
    p: &Conv2dParams,
    dtype: DType,
    layout: ConvLayout,
    major: u32,
) -> bool {
    if !supports(p) {
        return false;
    }
    let depthwise = p.groups() > 1 && p.c_in() == p.groups() && p.c_out().is_multiple_of(p.c_in());
    if depthwise {
        if layout == ConvLayout::Nhwc {
            return true;
        }
        let (sh, sw) = p.stride();
        return dtype == DType::F16
            && p.c_in() >= 32
            && p.dilation() == (1, 1)
            && (sh == sw || p.h() == 1)
            && depthwise_workload(p);
    }
    !(dtype == DType::BF16 && major < 8)
}

/// PyTorch's `check_cudnn_depthwise_workload_with_filter` (cuDNN 8.2 and later): the NCHW
/// f16 depthwise convolutions cuDNN runs faster than PyTorch's own kernel.
fn depthwise_workload(p: &Conv2dParams) -> bool {
    let stride = p.stride().1;
    if p.h() == 1 && stride == 1 {
        return true;
    }
    let (kh, kw) = p.kernel();
    if kh != kw || !matches!(kw, 1 | 3 | 5) {
        return false;
    }
    let (filter, w, ch, bs) = (kw, p.w(), p.c_in(), p.batch());
    if w < 7 {
        return false;
    }
    match stride {
        1 => true,
        2 if bs == 1 => (filter == 1 && w <= 28) || filter == 3 || filter == 5,
        2 => {
            (filter == 1 && bs <= 16 && ch >= 128 && w <= 7)
                || ((filter == 3 || filter == 5) && (ch >= 512 || (ch >= 256 && w >= 28)))
        }
        _ => false,
    }
}

/// A convolution's direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConvPass {
    /// `y = conv(x, w)`.
    Forward,
    /// The input's gradient.
    BackwardData,
    /// The weight's gradient.
    BackwardFilter,
}

/// Everything that decides a convolution's algorithm: the key of a CUDA device's algorithm
/// caches, as PyTorch's `ConvolutionParams` (which also holds the device and
/// `deterministic`; the caches are per device, and vram has no deterministic mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ConvKey {
    /// The input's logical dimensions `[batch, c_in, h, w]`, whatever the layout.
    pub x: [usize; 4],
    /// The weight's logical dimensions `[c_out, c_in / groups, kh, kw]`.
    pub w: [usize; 4],
    /// Zero padding `(h, w)`.
    pub padding: (usize, usize),
    /// Stride `(h, w)`.
    pub stride: (usize, usize),
    /// Dilation `(h, w)`.
    pub dilation: (usize, usize),
    /// Groups.
    pub groups: usize,
    /// The tensors' dtype.
    pub dtype: DType,
    /// The tensors' layout.
    pub layout: ConvLayout,
    /// Whether TF32 was allowed (`allow_tf32_cudnn`).
    pub allow_tf32: bool,
}

impl ConvKey {
    /// The key of convolution `p` in `dtype` and `layout`.
    pub fn new(p: &Conv2dParams, dtype: DType, layout: ConvLayout, allow_tf32: bool) -> Self {
        let (kh, kw) = p.kernel();
        ConvKey {
            x: [p.batch(), p.c_in(), p.h(), p.w()],
            w: [p.c_out(), p.c_in() / p.groups(), kh, kw],
            padding: p.padding(),
            stride: p.stride(),
            dilation: p.dilation(),
            groups: p.groups(),
            dtype,
            layout,
            allow_tf32,
        }
    }

    /// The output's logical dimensions, `[batch, c_out, oh, ow]`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the descriptors' only
    pub(crate) fn y(&self) -> [usize; 4] {
        let out = |size: usize, k: usize, pad: usize, stride: usize, dil: usize| {
            (size + 2 * pad - dil * (k - 1) - 1) / stride + 1
        };
        let oh = out(self.x[2], self.w[2], self.padding.0, self.stride.0, self.dilation.0);
        let ow = out(self.x[3], self.w[3], self.padding.1, self.stride.1, self.dilation.1);
        [self.x[0], self.w[0], oh, ow]
    }
}

/// One convolution shape and direction as cuDNN saw it, and what it chose (in files, the
/// key's fields stand beside `pass`, `algo` and `workspace`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConvChoice {
    /// The direction.
    pub pass: ConvPass,
    /// The convolution.
    #[serde(flatten)]
    pub key: ConvKey,
    /// The algorithm cuDNN ran, as cuDNN's enum names it.
    pub algo: String,
    /// Bytes of its workspace.
    pub workspace: usize,
    /// Bytes of the workspace the timed search that found it ran in (`cudnn_benchmark`:
    /// PyTorch's `getMaxWorkspaceSize`, the largest algorithm workspace within the
    /// allocator's `cacheInfo`); `None` when cuDNN's heuristics chose it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub search_workspace: Option<usize>,
}

/// A batch norm call through cuDNN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BnPass {
    /// The training forward (`cudnnBatchNormalizationForwardTrainingEx`).
    Training,
    /// The backward (`cudnnBatchNormalizationBackwardEx`).
    Backward,
}

/// What one batch norm call through cuDNN asked of the caching allocator.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BnChoice {
    /// The call.
    pub pass: BnPass,
    /// The input's shape as stored (`[n, c, ..]`, or `[n, h, w, c]` channels_last).
    pub shape: Vec<usize>,
    /// The input's dtype.
    pub dtype: DType,
    /// The input's layout.
    pub layout: ConvLayout,
    /// Bytes of its workspace.
    pub workspace: usize,
    /// Bytes of its reserve space (training; the backward takes none in vram).
    pub reserve: usize,
}

/// What one GPU's cuDNN chose: the device and cuDNN version it ran on, a [`ConvChoice`] per
/// convolution shape and direction that ran and a [`BnChoice`] per batch norm call (see the
/// module's docs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudnnChoices {
    /// The GPU, in words (`Device::name`).
    pub device: String,
    /// cuDNN's version number (91400 for 9.14.0).
    pub version: usize,
    /// The convolutions, in no particular order.
    pub convolutions: Vec<ConvChoice>,
    /// The batch norms through cuDNN (absent in older records: none).
    #[serde(default)]
    pub batch_norms: Vec<BnChoice>,
}

impl CudnnChoices {
    /// The workspace bytes the recorded choice for convolution `p` in `pass` took, or `None`
    /// when the record has no such call.
    pub fn workspace(
        &self,
        pass: ConvPass,
        p: &Conv2dParams,
        dtype: DType,
        layout: ConvLayout,
        allow_tf32: bool,
    ) -> Option<usize> {
        self.convolution(pass, &ConvKey::new(p, dtype, layout, allow_tf32)).map(|c| c.workspace)
    }

    /// The recorded choice for convolution `key` in `pass`, or `None` when the record has no
    /// such call.
    pub fn convolution(&self, pass: ConvPass, key: &ConvKey) -> Option<&ConvChoice> {
        self.convolutions.iter().find(|c| c.pass == pass && c.key == *key)
    }

    /// The recorded batch norm call `pass` on an input of `shape`, `dtype` and `layout`, or
    /// `None` when the record has no such call.
    pub fn batch_norm(
        &self,
        pass: BnPass,
        shape: &[usize],
        dtype: DType,
        layout: ConvLayout,
    ) -> Option<&BnChoice> {
        self.batch_norms
            .iter()
            .find(|b| b.pass == pass && b.shape == shape && b.dtype == dtype && b.layout == layout)
    }

    /// Sorted by shape and direction, so that two records of the same runs compare equal and
    /// a written file reads in a stable order.
    pub fn sort(&mut self) {
        self.batch_norms.sort_by(|a, b| {
            let key =
                |c: &BnChoice| (c.shape.clone(), c.dtype.index(), c.layout as u8, c.pass as u8);
            key(a).cmp(&key(b))
        });
        self.convolutions.sort_by(|a, b| {
            let key = |c: &ConvChoice| {
                let k = &c.key;
                let shape = (k.x, k.w, k.padding, k.stride, k.dilation, k.groups);
                (shape, k.dtype.index(), k.layout as u8, k.allow_tf32, c.pass as u8)
            };
            key(a).cmp(&key(b))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Conv2dOptions;

    /// PyTorch's backend choice (`use_cudnn_depthwise`, `use_cudnn`), case by case.
    #[test]
    fn convolutions_go_to_cudnn_where_pytorch_sends_them() {
        let conv = |x: [usize; 4], w: [usize; 4], stride: usize, groups: usize| {
            let o =
                Conv2dOptions::default().stride((stride, stride)).padding((1, 1)).groups(groups);
            Conv2dParams::new(&x, &w, &o).unwrap()
        };
        let (f32_, f16, bf16) = (DType::F32, DType::F16, DType::BF16);
        let (nchw, nhwc) = (ConvLayout::Nchw, ConvLayout::Nhwc);
        // MobileNetV3's depthwise 3x3 at 112 px, batch 64: channels_last always cuDNN; NCHW
        // only in f16 (PyTorch's own depthwise kernel in f32 and bf16).
        let dw = conv([64, 64, 112, 112], [64, 1, 3, 3], 1, 64);
        assert!(pytorch_uses_cudnn(&dw, f32_, nhwc, 9));
        assert!(pytorch_uses_cudnn(&dw, bf16, nhwc, 9));
        assert!(!pytorch_uses_cudnn(&dw, f32_, nchw, 9));
        assert!(!pytorch_uses_cudnn(&dw, bf16, nchw, 9));
        assert!(pytorch_uses_cudnn(&dw, f16, nchw, 9));
        // f16 NCHW: fewer than 32 channels, or a stride-2 workload the table refuses.
        let narrow = conv([64, 16, 112, 112], [16, 1, 3, 3], 1, 16);
        assert!(!pytorch_uses_cudnn(&narrow, f16, nchw, 9));
        let s2 = conv([64, 64, 112, 112], [64, 1, 3, 3], 2, 64);
        assert!(!pytorch_uses_cudnn(&s2, f16, nchw, 9), "stride 2 needs 256+ channels");
        let s2_wide = conv([64, 512, 14, 14], [512, 1, 3, 3], 2, 512);
        assert!(pytorch_uses_cudnn(&s2_wide, f16, nchw, 9));
        let one = conv([1, 64, 28, 28], [64, 1, 5, 5], 2, 64);
        assert!(pytorch_uses_cudnn(&one, f16, nchw, 9), "batch 1, 5x5 filter");
        let small = conv([8, 64, 6, 6], [64, 1, 3, 3], 1, 64);
        assert!(!pytorch_uses_cudnn(&small, f16, nchw, 9), "width under 7");
        // Grouped but not depthwise: an ordinary convolution.
        let grouped = conv([8, 64, 28, 28], [64, 32, 3, 3], 1, 2);
        assert!(pytorch_uses_cudnn(&grouped, f32_, nchw, 9));
        // bf16 needs compute capability 8; f16 and f32 do not.
        let dense = conv([8, 64, 28, 28], [64, 64, 3, 3], 1, 1);
        assert!(pytorch_uses_cudnn(&dense, bf16, nchw, 8));
        assert!(!pytorch_uses_cudnn(&dense, bf16, nchw, 7));
        assert!(!pytorch_uses_cudnn(&dense, bf16, nhwc, 7));
        assert!(pytorch_uses_cudnn(&dense, f16, nchw, 7));
        assert!(pytorch_uses_cudnn(&dense, f32_, nchw, 7));
    }

    fn choice(pass: ConvPass, workspace: usize) -> ConvChoice {
        ConvChoice {
            pass,
            key: ConvKey {
                x: [8, 64, 56, 56],
                w: [64, 64, 3, 3],
                padding: (1, 1),
                stride: (1, 1),
                dilation: (1, 1),
                groups: 1,
                dtype: DType::BF16,
                layout: ConvLayout::Nhwc,
                allow_tf32: true,
            },
            algo: "CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM".into(),
            workspace,
            search_workspace: None,
        }
    }

    #[test]
    fn a_choice_is_found_by_every_field_of_its_key_and_nothing_else() {
        let record = CudnnChoices {
            device: "test".into(),
            version: 91400,
            convolutions: vec![choice(ConvPass::Forward, 4096), choice(ConvPass::BackwardData, 0)],
            batch_norms: Vec::new(),
        };
        let opts = Conv2dOptions::default().padding((1, 1));
        let p = Conv2dParams::new(&[8, 64, 56, 56], &[64, 64, 3, 3], &opts).unwrap();
        let (bf16, nhwc) = (DType::BF16, ConvLayout::Nhwc);
        assert_eq!(record.workspace(ConvPass::Forward, &p, bf16, nhwc, true), Some(4096));
        assert_eq!(record.workspace(ConvPass::BackwardData, &p, bf16, nhwc, true), Some(0));
        assert_eq!(record.workspace(ConvPass::BackwardFilter, &p, bf16, nhwc, true), None);
        assert_eq!(record.workspace(ConvPass::Forward, &p, DType::F16, nhwc, true), None);
        assert_eq!(record.workspace(ConvPass::Forward, &p, bf16, ConvLayout::Nchw, true), None);
        assert_eq!(record.workspace(ConvPass::Forward, &p, bf16, nhwc, false), None);
        let strided = Conv2dParams::new(&[8, 64, 56, 56], &[64, 64, 3, 3], &opts.stride((2, 2)));
        assert_eq!(record.workspace(ConvPass::Forward, &strided.unwrap(), bf16, nhwc, true), None);
        let batch = Conv2dParams::new(&[4, 64, 56, 56], &[64, 64, 3, 3], &opts).unwrap();
        assert_eq!(record.workspace(ConvPass::Forward, &batch, bf16, nhwc, true), None);
    }

    #[test]
    fn a_record_reads_back_from_json_as_written() {
        let mut record = CudnnChoices {
            device: "NVIDIA H100 80GB HBM3".into(),
            version: 91400,
            convolutions: vec![
                choice(ConvPass::BackwardFilter, 1 << 20),
                choice(ConvPass::Forward, 4096),
            ],
            batch_norms: vec![BnChoice {
                pass: BnPass::Training,
                shape: vec![8, 56, 56, 64],
                dtype: DType::F16,
                layout: ConvLayout::Nhwc,
                workspace: 1024,
                reserve: 2048,
            }],
        };
        record.convolutions[1].search_workspace = Some(64 << 20);
        record.sort();
        assert_eq!(record.convolutions[0].pass, ConvPass::Forward);
        let text = serde_json::to_string(&record).unwrap();
        assert_eq!(text.matches("search_workspace").count(), 1, "none for the heuristics' choice");
        assert!(text.contains("\"backward_filter\"") && text.contains("\"nhwc\""), "{text}");
        assert!(text.contains("\"bf16\""), "{text}");
        let back: CudnnChoices = serde_json::from_str(&text).unwrap();
        assert_eq!(back, record);
        let bn = back.batch_norm(BnPass::Training, &[8, 56, 56, 64], DType::F16, ConvLayout::Nhwc);
        assert_eq!(bn.map(|b| (b.workspace, b.reserve)), Some((1024, 2048)));
        assert!(
            back.batch_norm(BnPass::Backward, &[8, 56, 56, 64], DType::F16, ConvLayout::Nhwc)
                .is_none()
        );
        assert_eq!(back.convolutions[0].search_workspace, Some(64 << 20));
        // A record written before batch norms and searches were recorded still reads.
        let old = r#"{"device": "x", "version": 1, "convolutions": []}"#;
        assert!(serde_json::from_str::<CudnnChoices>(old).unwrap().batch_norms.is_empty());
        let mut older = serde_json::to_value(choice(ConvPass::Forward, 8)).unwrap();
        older.as_object_mut().unwrap().remove("search_workspace");
        let read: ConvChoice = serde_json::from_value(older).unwrap();
        assert_eq!(read.search_workspace, None);
    }
}
